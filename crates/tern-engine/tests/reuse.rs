//! Duplicate and delta pages: real migrations over sockets, checked by
//! digest, with guests that hold duplicate pages and keep writing them.

use crate::common;

use std::time::Duration;

use common::*;
use tern_engine::{
    DeviceState, DirtyBitmap, DirtyLog, GuestControl, GuestMemory, GuestResult, LimitPolicy,
    MemoryRegion, MigrationConfig, MigrationStatus, PAGE_SIZE, Source, StateSection,
};
use tern_synthetic::{ContentMix, SyntheticConfig, SyntheticGuest};

/// Page `page` of every region from `SOURCE_PAGES` on becomes a copy of
/// page `page % SOURCE_PAGES` of region 0 when `page % 3 == 0`: duplicates
/// inside a packet, across packets, channels and regions; the working set
/// (the first quarter of memory) holds some, so the guest writes both
/// referenced and referencing pages while they move.
const SOURCE_PAGES: u64 = 300;

fn guest_with_duplicates(memory: u64, dirty_rate: u64) -> (SyntheticGuest, u64) {
    let guest = guest_with(SyntheticConfig {
        memory_bytes: memory,
        regions: 2,
        mix: ContentMix::default(),
        seed: 5,
        dirty_rate_bytes_per_sec: dirty_rate,
        working_set_bytes: memory / 4,
        dirtier_threads: 1,
    });
    let regions = guest.regions();
    let mut copies = 0;
    for region in regions {
        for page in (SOURCE_PAGES..region.pages()).filter(|page| page % 3 == 0) {
            let from = regions[0].page_ptr(page % SOURCE_PAGES).unwrap();
            let to = region.page_ptr(page).unwrap();
            // SAFETY: two distinct whole pages of the guest's live mapping;
            // the dirtier writes through raw pointers too and no reference
            // to guest memory exists.
            unsafe { std::ptr::copy_nonoverlapping(from.cast_const(), to, tern_engine::PAGE_SIZE) };
            copies += 1;
        }
    }
    (guest, copies)
}

fn migrate(guest: &mut SyntheticGuest, config: MigrationConfig) -> tern_engine::MigrationStats {
    let (listener, address) = tcp_listener();
    // A destination guest that never runs: a dirtying guest would go on
    // writing there once resumed, and the independent check below compares
    // memory as the switch-over left it on both sides.
    let destination = spawn_held_destination(listener);
    let stats = Source::new(config)
        .unwrap()
        .migrate(guest, &address)
        .expect("migration");
    let received = join_within(destination, "the destination")
        .expect("destination")
        .guest;
    assert_eq!(stats.status, MigrationStatus::Completed);
    assert!(stats.digest_verified);
    assert!(received.resumed, "the destination resumed after the commit");
    // The source stays paused after a completed migration.
    assert_eq!(received.guest.digest(), guest.digest());
    stats
}

#[test]
fn duplicate_pages_of_a_paused_guest_go_as_references_and_verify() {
    let (mut guest, copies) = guest_with_duplicates(32 * MIB, 0);
    let stats = migrate(&mut guest, migration_config(3));
    let dedup = stats.dedup.expect("duplicates were found");
    // Copies of zero pages are zero pages; about half the sources hold data.
    assert!(dedup.pages > copies / 3, "{dedup:?} of {copies} copies");
    assert_eq!(dedup.bytes_saved, dedup.pages * (4096 - 8));
    assert!(stats.xbzrle_cache.is_none());
    let plain = migrate(&mut guest_with_duplicates(32 * MIB, 0).0, {
        let mut config = migration_config(3);
        config.dedup = false;
        config
    });
    assert!(plain.dedup.is_none());
    assert!(
        stats.ram.transferred + dedup.pages * 4000 <= plain.ram.transferred + (1 << 20),
        "references saved nothing: {} against {}",
        stats.ram.transferred,
        plain.ram.transferred
    );
}

/// A slow link and a busy dirtier: many iterations, pages re-sent as deltas
/// against the cache, duplicates of pages the guest keeps writing.
fn running_config(delta_cache_size: u64) -> MigrationConfig {
    {
        let mut config = migration_config(3);
        config.max_bandwidth = Some(48 * MIB);
        config.delta_cache_size = delta_cache_size;
        // The whole working set is dirty at every sync: a short limit keeps
        // the migration iterating until the iteration limit forces it over.
        config.downtime_limit = Duration::from_millis(20);
        config.max_iterations = Some(6);
        config.limit_policy = LimitPolicy::SwitchOver;
        config.max_time = Some(Duration::from_secs(90));
        config
    }
}

#[test]
fn a_dirtying_guest_with_duplicates_and_deltas_verifies() {
    let (mut guest, _) = guest_with_duplicates(32 * MIB, 24 * MIB);
    let stats = migrate(&mut guest, running_config(16 * MIB));
    assert!(stats.ram.dirty_sync_count >= 3, "{:?}", stats.ram);
    let xbzrle = stats.xbzrle_cache.expect("the cache reports");
    assert_eq!(xbzrle.cache_size, 16 * MIB);
    assert!(xbzrle.pages > 0, "{xbzrle:?}");
    assert!(xbzrle.encoding_rate > 10.0, "{xbzrle:?}");
    assert!(stats.dedup.is_some_and(|dedup| dedup.pages > 0));
}

#[test]
fn a_delta_cache_smaller_than_the_working_set_misses_and_verifies() {
    let (mut guest, _) = guest_with_duplicates(32 * MIB, 24 * MIB);
    let stats = migrate(&mut guest, {
        let mut config = running_config(256 << 10);
        config.dedup = false;
        config
    });
    let xbzrle = stats.xbzrle_cache.expect("the cache reports");
    assert!(xbzrle.cache_miss > 0, "{xbzrle:?}");
    assert!(stats.dedup.is_none());
}

#[test]
fn a_delta_cache_with_zero_copy_is_refused_up_front() {
    let config = {
        let mut config = migration_config(1);
        config.zero_copy = true;
        config.delta_cache_size = MIB;
        config
    };
    let Err(error) = Source::new(config) else {
        panic!("a delta cache with zero-copy was accepted");
    };
    let error = error.to_string();
    assert!(error.contains("delta cache"), "{error}");
}

#[test]
fn deltas_created_on_the_software_dsa_device_with_faults_verify() {
    let offload = tern_dsa::software_delta_offload(tern_dsa::SoftwareDsaConfig {
        // Every third descriptor faults part-way, every fifth fails: the
        // CPU redoes those, with the same bytes.
        fault_if: Some(std::sync::Arc::new(|n, _| n % 3 == 0)),
        fault_after_bytes: 2048,
        error_if: Some(std::sync::Arc::new(|n, _| n % 5 == 0)),
        ..Default::default()
    });
    let (mut guest, _) = guest_with_duplicates(32 * MIB, 24 * MIB);
    let stats = migrate(&mut guest, {
        let mut config = running_config(16 * MIB);
        config.delta_offload = Some(offload.clone());
        config
    });
    assert!(stats.xbzrle_cache.is_some_and(|cache| cache.pages > 0));
    let device = tern_engine::DeltaOffload::stats(&*offload);
    assert!(device.on_device > 0, "{device:?}");
    assert!(device.fallbacks > 0, "{device:?}");
}

/// A guest that, while it runs, rewrites its first `pages` pages whole with
/// new pseudo-random words at every dirty-log sync (and reports them
/// dirty): pages come back every pass and no delta can help them.
struct RewritingGuest {
    inner: SyntheticGuest,
    pages: u64,
    running: bool,
    seed: u64,
}

impl RewritingGuest {
    fn rewrite(&mut self, bitmap: &mut DirtyBitmap) {
        let region = &self.inner.regions()[0];
        for page in 0..self.pages {
            let words = region
                .page_ptr(page)
                .expect("a page of the region")
                .cast::<u64>();
            for word in 0..PAGE_SIZE / 8 {
                self.seed ^= self.seed << 13;
                self.seed ^= self.seed >> 7;
                self.seed ^= self.seed << 17;
                // SAFETY: a word of a whole page of the guest's live mapping
                // (pages are 8-byte aligned); no reference to guest memory
                // exists, and the engine reads it through raw pointers.
                unsafe { words.add(word).write_volatile(self.seed) };
            }
            bitmap.set(page);
        }
    }
}

impl GuestMemory for RewritingGuest {
    fn regions(&self) -> &[MemoryRegion] {
        self.inner.regions()
    }
}

impl DirtyLog for RewritingGuest {
    fn start_dirty_log(&mut self) -> GuestResult<()> {
        self.inner.start_dirty_log()
    }

    fn sync_dirty_log(&mut self, bitmaps: &mut [DirtyBitmap]) -> GuestResult<()> {
        self.inner.sync_dirty_log(bitmaps)?;
        if self.running {
            self.rewrite(&mut bitmaps[0]);
        }
        Ok(())
    }

    fn stop_dirty_log(&mut self) -> GuestResult<()> {
        self.inner.stop_dirty_log()
    }
}

impl GuestControl for RewritingGuest {
    fn pause(&mut self) -> GuestResult<()> {
        self.running = false;
        self.inner.pause()
    }

    fn resume(&mut self) -> GuestResult<()> {
        self.running = true;
        self.inner.resume()
    }

    fn set_throttle(&mut self, percent: u8) -> GuestResult<()> {
        self.inner.set_throttle(percent)
    }
}

impl DeviceState for RewritingGuest {
    fn save_state(&mut self) -> GuestResult<Vec<StateSection>> {
        self.inner.save_state()
    }

    fn restore_state(&mut self, sections: &[StateSection]) -> GuestResult<()> {
        self.inner.restore_state(sections)
    }

    fn state_size_hint(&self) -> u64 {
        self.inner.state_size_hint()
    }
}

#[test]
fn pages_rewritten_whole_close_the_delta_gate_and_verify() {
    const REWRITTEN: u64 = 2048;
    let mut guest = RewritingGuest {
        inner: guest_with(SyntheticConfig {
            memory_bytes: 32 * MIB,
            regions: 1,
            mix: ContentMix::default(),
            seed: 9,
            dirty_rate_bytes_per_sec: 0,
            working_set_bytes: 0,
            dirtier_threads: 1,
        }),
        pages: REWRITTEN,
        running: true,
        seed: 0x9e37_79b9_7f4a_7c15,
    };
    let (listener, address) = tcp_listener();
    let destination = spawn_destination(listener);
    let stats = Source::new({
        let mut config = running_config(16 * MIB);
        config.dedup = false;
        config
    })
    .unwrap()
    .migrate(&mut guest, &address)
    .expect("migration");
    let mut received = join_within(destination, "the destination")
        .expect("destination")
        .guest;
    assert_eq!(stats.status, MigrationStatus::Completed);
    assert!(stats.digest_verified);
    received.pause().unwrap();
    assert_eq!(received.digest(), guest.inner.digest());
    // The first pass goes around the cache; the second caches the
    // rewritten pages (misses); from the third on every lookup overflows,
    // and once a worker has seen a window of them only a sample is looked
    // up: far fewer lookups than rewritten pages per pass.
    let passes_after_the_second = stats.ram.dirty_sync_count.saturating_sub(2);
    assert!(passes_after_the_second >= 2, "{:?}", stats.ram);
    let xbzrle = stats.xbzrle_cache.expect("the cache reports");
    assert!(xbzrle.overflow > 0, "{xbzrle:?}");
    assert!(
        xbzrle.overflow < REWRITTEN * passes_after_the_second / 2,
        "the gate did not close: {xbzrle:?} over {} syncs",
        stats.ram.dirty_sync_count
    );
    assert!(xbzrle.cache_miss >= REWRITTEN, "{xbzrle:?}");
}
