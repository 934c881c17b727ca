//! Hybrid postcopy: precopy first, then the guest moves before all of its
//! memory has (docs/postcopy.md).
//!
//! When precopy cannot converge, the source pauses the guest, tells the
//! destination which of the pages it holds are stale, and sends the device
//! state; once the destination is ready and the source commits (the point
//! of no return), the guest runs on the destination. Stale pages are
//! registered there with userfaultfd (the fault service, `fault/`): a
//! guest thread that touches one waits while the page is requested from
//! the source on the main channel, which then carries nothing but these
//! requests and their answers (the urgent path), while every page channel
//! pushes the remaining stale pages in the background, starting near the
//! most recent request. The source's memory stays frozen, so a page
//! delivered twice carries the same bytes, and the kernel places it once.
//!
//! This module holds what both sides share: the mode, the decision to
//! switch, the stale-page set and the report. `source/postcopy.rs` and
//! `destination/postcopy.rs` run the two halves.

mod decide;

use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};
use tern_wire::{PageRun, SessionSetup};

use crate::bitmap::DirtyBitmap;

pub(crate) use decide::{PostcopyFacts, switch_to_postcopy};

/// When precopy hands over to postcopy. QEMU, libvirt, KubeVirt and Cloud
/// Hypervisor names are mapped in docs/cli.md.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    strum::EnumString,
    strum::IntoStaticStr,
    strum::EnumIter,
)]
#[strum(serialize_all = "kebab-case")]
#[non_exhaustive]
pub enum PostcopyMode {
    /// Precopy only: a guest that cannot converge is throttled, or the
    /// migration gives up at its limits.
    #[default]
    Off,
    /// Precopy until asked (`migrate-start-postcopy`, or
    /// `MigrationConfig::postcopy_after` elapsed), then postcopy.
    OnRequest,
    /// Precopy while it converges; postcopy instead of throttling the
    /// guest past `MigrationConfig::postcopy_max_throttle`, and instead of
    /// giving up or forcing a long switch-over at a limit.
    Auto,
    /// One full precopy pass, then postcopy.
    AfterFirstPass,
}

impl PostcopyMode {
    /// The name used on the command line and in statistics.
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

/// Why precopy handed over to postcopy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum PostcopyTrigger {
    /// An operator asked (`migrate-start-postcopy`).
    Requested,
    /// `postcopy_after` elapsed.
    Timer,
    /// `auto`: precopy would have throttled the guest past the limit.
    Throttle,
    /// `auto`: an iteration or time limit was reached.
    Limit,
    /// `after-first-pass`.
    FirstPass,
}

/// What postcopy did, with QEMU's names where it has them.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub struct PostcopyReport {
    /// Why precopy handed over (absent on the destination, which is not
    /// told).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub trigger: Option<PostcopyTrigger>,
    /// Pages that were stale at the switch: what postcopy had to deliver.
    pub stale_pages: u64,
    /// Bytes the source wrote after the switch (QEMU's `postcopy-bytes`):
    /// urgent pages and the background push.
    pub postcopy_bytes: u64,
    /// Page requests (QEMU's `postcopy-requests`).
    pub postcopy_requests: u64,
    /// Pages sent because they were requested.
    pub requested_pages: u64,
    /// Pages sent by the background push.
    pub pushed_pages: u64,
    /// Stale pages the background push left out because an urgent answer
    /// had already claimed them (source only).
    #[serde(default)]
    pub push_skipped_pages: u64,
    /// Neighbours of a faulting page that an urgent answer left out
    /// because the background push had claimed them: on their way on a
    /// page channel (source only).
    #[serde(default)]
    pub answer_skipped_pages: u64,
    /// Pages the source sent twice: faulting pages answered although the
    /// push had claimed them already (source only; without a recovery,
    /// `pushed-pages` + `requested-pages` = `stale-pages` + this).
    #[serde(default)]
    pub resent_pages: u64,
    /// The codec the background push compressed its data pages with:
    /// the one precopy had in force at the switch (source only; absent
    /// when the push sent them raw).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub push_codec: Option<String>,
    /// Bytes of the background push's packets (headers, tables, pages),
    /// part of `postcopy-bytes` (source only): against `pushed-pages` ×
    /// 4096, what the codec and zero pages saved.
    #[serde(default)]
    pub push_bytes: u64,
    /// Pushed pages that went compressed (source only).
    #[serde(default)]
    pub push_compressed_pages: u64,
    /// Pushed pages that went as zero pages, without bytes (source only).
    #[serde(default)]
    pub push_zero_pages: u64,
    /// Page faults the destination answered.
    pub faults: u64,
    /// Average time from a fault to its page being placed, µs.
    pub fault_latency_avg_us: f64,
    /// Faults per latency bucket: entry `i` counts faults answered in
    /// `[2^i, 2^(i+1))` µs (QEMU 10.1's `postcopy-latency-dist`, in µs).
    pub fault_latency_histogram_us: Vec<u64>,
    /// Time guest threads spent blocked on faults, summed, ms (QEMU's
    /// `postcopy-blocktime`; per thread, not per vCPU).
    pub postcopy_blocktime: f64,
    /// Time from the guest resuming on the destination until every page
    /// was placed there, ms.
    pub delivered_after_ms: f64,
    /// Times postcopy was paused by a broken or silent connection and
    /// recovered (docs/postcopy.md, "Recovery").
    #[serde(default)]
    pub postcopy_recoveries: u64,
    /// Time spent `postcopy-paused`, summed, ms.
    #[serde(default)]
    pub postcopy_paused_ms: f64,
}

impl PostcopyReport {
    /// Fills in the destination's figures from its completion message.
    pub(crate) fn add_destination(&mut self, complete: &tern_wire::PostcopyComplete) {
        self.faults = complete.faults;
        self.postcopy_blocktime = complete.blocktime_micros as f64 / 1000.0;
        self.fault_latency_avg_us = if complete.faults == 0 {
            0.0
        } else {
            complete.blocktime_micros as f64 / complete.faults as f64
        };
        self.fault_latency_histogram_us = trimmed(&complete.latency_histogram);
        self.delivered_after_ms = complete.delivered_micros as f64 / 1000.0;
    }
}

/// Whether a postcopy failure is a lost connection (closed, reset, silent
/// past its deadline, or not reconnectable yet), which recovery may mend,
/// rather than a peer that misbehaved or gave up, which it may not.
pub(crate) fn is_recoverable(error: &crate::error::MigrationError) -> bool {
    use crate::error::{ChannelError, MigrationError};
    matches!(
        error,
        MigrationError::Channel {
            source: ChannelError::Closed
                | ChannelError::Io(_)
                | ChannelError::Timeout(_)
                | ChannelError::Connect(..),
            ..
        }
    )
}

/// A histogram without its empty tail.
pub(crate) fn trimmed(histogram: &[u64]) -> Vec<u64> {
    let used = histogram
        .iter()
        .rposition(|&count| count != 0)
        .map_or(0, |last| last + 1);
    histogram[..used].to_vec()
}

/// The power-of-two bucket of a latency in nanoseconds (in µs buckets).
pub(crate) fn latency_bucket(nanos: u64) -> usize {
    let micros = nanos / 1000;
    let bucket = if micros == 0 {
        0
    } else {
        micros.ilog2() as usize
    };
    bucket.min(tern_wire::LATENCY_BUCKETS - 1)
}

/// One bit per page, set concurrently.
#[derive(Debug)]
pub(crate) struct PageBits {
    words: Vec<AtomicU64>,
    pages: u64,
}

impl PageBits {
    pub(crate) fn new(pages: u64) -> Self {
        Self {
            words: (0..pages.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
            pages,
        }
    }

    /// Sets the bit; returns whether it was set before. Out of range: true
    /// (nothing to do).
    pub(crate) fn set(&self, page: u64) -> bool {
        if page >= self.pages {
            return true;
        }
        let bit = 1 << (page % 64);
        self.words[(page / 64) as usize].fetch_or(bit, Ordering::AcqRel) & bit != 0
    }

    /// Clears the bit (out of range: nothing).
    pub(crate) fn clear(&self, page: u64) {
        if page < self.pages {
            self.words[(page / 64) as usize].fetch_and(!(1 << (page % 64)), Ordering::AcqRel);
        }
    }

    pub(crate) fn get(&self, page: u64) -> bool {
        page < self.pages
            && self.words[(page / 64) as usize].load(Ordering::Acquire) & (1 << (page % 64)) != 0
    }

    pub(crate) fn pages(&self) -> u64 {
        self.pages
    }
}

/// The pages that were stale at the switch, per region (in the setup's
/// order): the source's final dirty bitmap, the destination's discard list.
#[derive(Debug)]
pub(crate) struct StaleSet {
    regions: Vec<PageBits>,
    total: u64,
}

impl StaleSet {
    /// From the source's dirty bitmaps.
    pub(crate) fn from_dirty(bitmaps: &[DirtyBitmap]) -> Self {
        let regions: Vec<PageBits> = bitmaps
            .iter()
            .map(|bitmap| {
                let bits = PageBits::new(bitmap.pages());
                for page in bitmap.iter_dirty() {
                    bits.set(page);
                }
                bits
            })
            .collect();
        let total = bitmaps.iter().map(DirtyBitmap::count).sum();
        Self { regions, total }
    }

    /// From the runs of the source's switch frames, each checked against
    /// the session's regions; a run outside guest memory or naming an
    /// unknown region is the peer's error, and so is a page named twice.
    pub(crate) fn from_runs(setup: &SessionSetup, runs: &[PageRun]) -> Result<Self, String> {
        let regions: Vec<PageBits> = setup
            .regions
            .iter()
            .map(|region| PageBits::new(region.pages()))
            .collect();
        let mut total = 0;
        for run in runs {
            let index = setup
                .regions
                .iter()
                .position(|region| region.id == run.region_id)
                .ok_or_else(|| format!("stale run names unknown region {}", run.region_id))?;
            let bits = &regions[index];
            if run.end() > bits.pages() {
                return Err(format!(
                    "stale pages {}..{} of region {} lie outside its {} pages",
                    run.first_page,
                    run.end(),
                    run.region_id,
                    bits.pages()
                ));
            }
            for page in u64::from(run.first_page)..run.end() {
                if bits.set(page) {
                    return Err(format!(
                        "stale page {page} of region {} named twice",
                        run.region_id
                    ));
                }
            }
            total += u64::from(run.pages);
        }
        Ok(Self { regions, total })
    }

    /// The stale pages as runs, region by region, in order.
    pub(crate) fn runs(&self, setup: &SessionSetup) -> Vec<PageRun> {
        let mut runs = Vec::new();
        for (bits, region) in self.regions.iter().zip(&setup.regions) {
            let mut page = 0;
            while page < bits.pages() {
                if !bits.get(page) {
                    page += 1;
                    continue;
                }
                let first = page;
                while page < bits.pages() && bits.get(page) && page - first < u64::from(u32::MAX) {
                    page += 1;
                }
                runs.push(PageRun {
                    region_id: region.id,
                    first_page: u32::try_from(first).unwrap_or(u32::MAX),
                    pages: u32::try_from(page - first).unwrap_or(u32::MAX),
                });
            }
        }
        runs
    }

    pub(crate) fn contains(&self, region: usize, page: u64) -> bool {
        self.regions.get(region).is_some_and(|bits| bits.get(page))
    }

    pub(crate) fn total(&self) -> u64 {
        self.total
    }

    pub(crate) fn region_count(&self) -> usize {
        self.regions.len()
    }

    /// Pages in region `region`.
    pub(crate) fn region_pages(&self, region: usize) -> u64 {
        self.regions.get(region).map_or(0, PageBits::pages)
    }
}

#[cfg(test)]
mod tests {
    use super::{StaleSet, latency_bucket, trimmed};
    use crate::bitmap::DirtyBitmap;
    use tern_wire::{DigestAlgorithm, PageRun, RegionInfo, SessionSetup};

    fn setup() -> SessionSetup {
        SessionSetup {
            page_size: tern_wire::PAGE_SIZE,
            channel_count: 1,
            codecs: 0,
            digest: DigestAlgorithm::Xxh3Pages,
            regions: vec![
                RegionInfo {
                    id: 4,
                    guest_addr: 0,
                    len: 100 << 12,
                },
                RegionInfo {
                    id: 9,
                    guest_addr: 1 << 30,
                    len: 10 << 12,
                },
            ],
            guest_kind: String::new(),
            dictionaries: 0,
            vmm_config_len: 0,
        }
    }

    #[test]
    fn dirty_bitmaps_become_runs_and_back() {
        let mut first = DirtyBitmap::new(100);
        for page in [0, 1, 2, 63, 64, 65, 99] {
            first.set(page);
        }
        let mut second = DirtyBitmap::new(10);
        second.set(9);
        let stale = StaleSet::from_dirty(&[first, second]);
        assert_eq!(stale.total(), 8);
        let runs = stale.runs(&setup());
        let run = |region_id, first_page, pages| PageRun {
            region_id,
            first_page,
            pages,
        };
        assert_eq!(
            runs,
            [run(4, 0, 3), run(4, 63, 3), run(4, 99, 1), run(9, 9, 1)]
        );
        let back = StaleSet::from_runs(&setup(), &runs).unwrap();
        assert_eq!(back.total(), 8);
        assert!(back.contains(0, 64) && back.contains(1, 9) && !back.contains(0, 3));
    }

    #[test]
    fn runs_outside_memory_unknown_or_repeated_are_refused() {
        let run = |region_id, first_page, pages| PageRun {
            region_id,
            first_page,
            pages,
        };
        for runs in [
            vec![run(4, 99, 2)],
            vec![run(9, 10, 1)],
            vec![run(5, 0, 1)],
            vec![run(4, 0, 3), run(4, 2, 1)],
        ] {
            assert!(StaleSet::from_runs(&setup(), &runs).is_err(), "{runs:?}");
        }
    }

    #[test]
    fn latencies_fall_in_power_of_two_buckets() {
        assert_eq!(latency_bucket(0), 0);
        assert_eq!(latency_bucket(1_999), 0);
        assert_eq!(latency_bucket(2_000), 1);
        assert_eq!(latency_bucket(1_000_000), 9);
        assert_eq!(latency_bucket(u64::MAX), tern_wire::LATENCY_BUCKETS - 1);
        assert_eq!(trimmed(&[1, 0, 2, 0, 0]), [1, 0, 2]);
        assert!(trimmed(&[0, 0]).is_empty());
    }
}
