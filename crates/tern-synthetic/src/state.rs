//! The dirtier's state section: encoding and fully validated decoding.
//!
//! Layout of version 1, all integers little-endian:
//!
//! | offset | size | field                                   |
//! |--------|------|-----------------------------------------|
//! | 0      | 8    | seed                                    |
//! | 8      | 8    | dirty rate, bytes per second            |
//! | 16     | 8    | working set, pages                      |
//! | 24     | 8    | memory size, pages (checked on restore) |
//! | 32     | 1    | throttle, percent                       |
//! | 33     | 4    | dirtier thread count `n`                |
//! | 37     | 24n  | per thread: PRNG state, pages written, rate credit |

use tern_engine::{GuestError, GuestResult, PAGE_SIZE, StateSection};

use crate::rng::{WyRand, hash2};

/// Name of the one state section the synthetic guest saves.
pub const SECTION_NAME: &str = "synthetic-dirtier";
/// Version of the section layout this crate writes and reads.
pub const SECTION_VERSION: u32 = 1;
/// Most dirtier threads a guest may have; bounds the size of a section.
pub const MAX_DIRTIER_THREADS: u32 = 64;

const HEADER_LEN: usize = 37;
const THREAD_LEN: usize = 24;

/// Rate credit is kept in byte-nanoseconds (bytes per second times elapsed
/// nanoseconds) so no precision is lost between 1 ms slices; one page is due
/// per this many units.
pub(crate) const CREDIT_PER_PAGE: u64 = PAGE_SIZE as u64 * 1_000_000_000;

/// What the dirtier does: fixed for the guest's life (or until a restore).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DirtierConfig {
    pub(crate) seed: u64,
    pub(crate) rate: u64,
    pub(crate) working_set_pages: u64,
    pub(crate) threads: u32,
}

impl DirtierConfig {
    /// Thread `index`'s share of the rate; the remainder goes to the first
    /// threads so the shares add up to the configured rate exactly.
    pub(crate) fn rate_share(&self, index: usize) -> u64 {
        let threads = u64::from(self.threads);
        self.rate / threads + u64::from((index as u64) < self.rate % threads)
    }

    /// The state each thread starts from, derived from the seed so two
    /// guests with the same configuration dirty the same pages.
    pub(crate) fn initial_states(&self) -> Vec<ThreadState> {
        (0..self.threads)
            .map(|index| ThreadState {
                rng: WyRand(hash2(self.seed, 0xd1a7_0000 + u64::from(index))),
                pages: 0,
                credit: 0,
            })
            .collect()
    }
}

/// One dirtier thread's progress: enough to continue its exact sequence of
/// writes elsewhere.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ThreadState {
    pub(crate) rng: WyRand,
    /// Pages this thread's sequence has written, across migrations.
    pub(crate) pages: u64,
    /// Unspent rate credit, below [`CREDIT_PER_PAGE`].
    pub(crate) credit: u64,
}

/// Everything in a section.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SavedState {
    pub(crate) config: DirtierConfig,
    pub(crate) total_pages: u64,
    pub(crate) throttle: u8,
    pub(crate) threads: Vec<ThreadState>,
}

impl SavedState {
    pub(crate) fn encode(&self) -> StateSection {
        let mut data = Vec::with_capacity(HEADER_LEN + THREAD_LEN * self.threads.len());
        data.extend_from_slice(&self.config.seed.to_le_bytes());
        data.extend_from_slice(&self.config.rate.to_le_bytes());
        data.extend_from_slice(&self.config.working_set_pages.to_le_bytes());
        data.extend_from_slice(&self.total_pages.to_le_bytes());
        data.push(self.throttle);
        data.extend_from_slice(&self.config.threads.to_le_bytes());
        for thread in &self.threads {
            data.extend_from_slice(&thread.rng.0.to_le_bytes());
            data.extend_from_slice(&thread.pages.to_le_bytes());
            data.extend_from_slice(&thread.credit.to_le_bytes());
        }
        StateSection {
            name: SECTION_NAME.to_owned(),
            version: SECTION_VERSION,
            data,
        }
    }

    /// Decodes and validates a section for a guest of `total_pages` pages.
    pub(crate) fn decode(section: &StateSection, total_pages: u64) -> GuestResult<Self> {
        check_name_and_version(section)?;
        let data = &section.data;
        if data.len() < HEADER_LEN {
            return Err(GuestError::new(format!(
                "state section {SECTION_NAME:?} is truncated: {} bytes, the header alone is {HEADER_LEN}",
                data.len()
            )));
        }
        let mut reader = Reader { data, pos: 0 };
        let seed = reader.u64();
        let rate = reader.u64();
        let working_set_pages = reader.u64();
        let saved_pages = reader.u64();
        let throttle = reader.u8();
        let threads = reader.u32();
        if threads == 0 || threads > MAX_DIRTIER_THREADS {
            return Err(GuestError::new(format!(
                "state section {SECTION_NAME:?}: dirtier thread count {threads} is outside 1..={MAX_DIRTIER_THREADS}"
            )));
        }
        let expected = HEADER_LEN + THREAD_LEN * threads as usize;
        if data.len() != expected {
            return Err(GuestError::new(format!(
                "state section {SECTION_NAME:?} is {} bytes, expected {expected} for {threads} dirtier threads",
                data.len()
            )));
        }
        if saved_pages != total_pages {
            return Err(GuestError::new(format!(
                "state section {SECTION_NAME:?} is for a guest of {saved_pages} pages, this guest has {total_pages}"
            )));
        }
        if working_set_pages == 0 || working_set_pages > total_pages {
            return Err(GuestError::new(format!(
                "state section {SECTION_NAME:?}: working set of {working_set_pages} pages is outside 1..={total_pages}"
            )));
        }
        if throttle > 99 {
            return Err(GuestError::new(format!(
                "state section {SECTION_NAME:?}: throttle {throttle}% is above 99%"
            )));
        }
        let states = read_thread_states(&mut reader, threads)?;
        Ok(Self {
            config: DirtierConfig {
                seed,
                rate,
                working_set_pages,
                threads,
            },
            total_pages,
            throttle,
            threads: states,
        })
    }
}

/// The section is this guest's, in the layout this build reads.
fn check_name_and_version(section: &StateSection) -> GuestResult<()> {
    if section.name != SECTION_NAME {
        return Err(GuestError::new(format!(
            "unexpected state section {:?}, the synthetic guest only has {SECTION_NAME:?}",
            section.name
        )));
    }
    if section.version != SECTION_VERSION {
        return Err(GuestError::new(format!(
            "state section {SECTION_NAME:?} has version {}, this guest reads version {SECTION_VERSION}",
            section.version
        )));
    }
    Ok(())
}

/// Each dirtier thread's saved state, its rate credit below a page's.
fn read_thread_states(reader: &mut Reader<'_>, threads: u32) -> GuestResult<Vec<ThreadState>> {
    let mut states = Vec::with_capacity(threads as usize);
    for index in 0..threads {
        let state = ThreadState {
            rng: WyRand(reader.u64()),
            pages: reader.u64(),
            credit: reader.u64(),
        };
        if state.credit >= CREDIT_PER_PAGE {
            return Err(GuestError::new(format!(
                "state section {SECTION_NAME:?}: dirtier thread {index} has rate credit {} of at most {}",
                state.credit,
                CREDIT_PER_PAGE - 1
            )));
        }
        states.push(state);
    }
    Ok(states)
}

/// Reads fixed-size fields; callers check the length first, so the slicing
/// below cannot go out of bounds.
struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> [u8; N] {
        let mut bytes = [0; N];
        bytes.copy_from_slice(&self.data[self.pos..self.pos + N]);
        self.pos += N;
        bytes
    }

    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take())
    }

    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take())
    }

    fn u8(&mut self) -> u8 {
        self.take::<1>()[0]
    }
}

#[cfg(test)]
#[expect(
    clippy::cast_possible_truncation,
    reason = "test data is made by truncating random numbers"
)]
mod tests {
    use super::*;

    fn sample() -> SavedState {
        let config = DirtierConfig {
            seed: 9,
            rate: 1 << 20,
            working_set_pages: 100,
            threads: 3,
        };
        let mut threads = config.initial_states();
        threads[1].pages = 77;
        threads[2].credit = CREDIT_PER_PAGE - 1;
        SavedState {
            config,
            total_pages: 1000,
            throttle: 40,
            threads,
        }
    }

    fn error_of(section: &StateSection, pages: u64) -> String {
        SavedState::decode(section, pages).unwrap_err().to_string()
    }

    #[test]
    fn round_trip() {
        let saved = sample();
        let section = saved.encode();
        assert_eq!(section.data.len(), HEADER_LEN + 3 * THREAD_LEN);
        assert_eq!(SavedState::decode(&section, 1000).unwrap(), saved);
    }

    #[test]
    fn rate_shares_add_up() {
        let config = DirtierConfig {
            seed: 0,
            rate: 1001,
            working_set_pages: 1,
            threads: 3,
        };
        let shares: Vec<u64> = (0..3).map(|i| config.rate_share(i)).collect();
        assert_eq!(shares, vec![334, 334, 333]);
    }

    #[test]
    fn rejects_bad_sections() {
        let good = sample().encode();

        let mut named = good.clone();
        named.name = "vcpu0".into();
        assert!(error_of(&named, 1000).contains("\"vcpu0\""));

        let mut versioned = good.clone();
        versioned.version = 2;
        assert!(error_of(&versioned, 1000).contains("version 2"));

        let mut short = good.clone();
        short.data.truncate(20);
        assert!(error_of(&short, 1000).contains("truncated"));

        let mut cut = good.clone();
        cut.data.pop();
        assert!(error_of(&cut, 1000).contains("expected"));

        let mut long = good.clone();
        long.data.push(0);
        assert!(error_of(&long, 1000).contains("expected"));

        assert!(error_of(&good, 999).contains("1000 pages"));

        let mut state = sample();
        state.config.working_set_pages = 1001;
        assert!(error_of(&state.encode(), 1000).contains("working set"));
        state.config.working_set_pages = 0;
        assert!(error_of(&state.encode(), 1000).contains("working set"));

        let mut state = sample();
        state.throttle = 100;
        assert!(error_of(&state.encode(), 1000).contains("throttle"));

        let mut state = sample();
        state.threads[0].credit = CREDIT_PER_PAGE;
        assert!(error_of(&state.encode(), 1000).contains("credit"));

        for threads in [0u32, 65, u32::MAX] {
            let mut section = good.clone();
            section.data[33..37].copy_from_slice(&threads.to_le_bytes());
            assert!(error_of(&section, 1000).contains("thread count"));
        }
    }

    #[test]
    fn random_bytes_never_panic() {
        let mut rng = WyRand(1234);
        let good = sample().encode();
        for round in 0..20_000u32 {
            let data = if round % 2 == 0 {
                let len = rng.below(200) as usize;
                (0..len).map(|_| rng.next_u64() as u8).collect()
            } else {
                // Mutations of a valid blob reach the deeper checks.
                let mut data = good.data.clone();
                for _ in 0..=rng.below(4) {
                    let at = rng.below(data.len() as u64) as usize;
                    data[at] = rng.next_u64() as u8;
                }
                data.truncate(rng.below(data.len() as u64 + 1) as usize);
                data
            };
            let section = StateSection {
                name: SECTION_NAME.into(),
                version: SECTION_VERSION,
                data,
            };
            let _ = SavedState::decode(&section, 1000);
        }
    }
}
