//! `auto` end to end: what it decides (codec, dictionary, delta cache) is
//! in the report with its reason, and the migration it decides for
//! verifies by digest.

use crate::common;

use std::time::Duration;

use common::*;
use tern_engine::{GuestControl, GuestMemory, MigrationStatus, Source};
use tern_page::codec::CodecChoice;

/// A synthetic guest that, at every dirty-log sync, adds one to the first
/// byte of each page of its working set (as bench/compare's test guest
/// does), so every iteration from the first on sends the same pages again
/// with one byte changed: deterministic, and what a delta cache is for.
struct IncrementingGuest {
    inner: tern_synthetic::SyntheticGuest,
    working_set_pages: u64,
}

impl IncrementingGuest {
    fn new(memory: u64, working_set_pages: u64) -> Self {
        Self {
            inner: guest(memory, 0),
            working_set_pages,
        }
    }
}

impl tern_engine::GuestMemory for IncrementingGuest {
    fn regions(&self) -> &[tern_engine::MemoryRegion] {
        self.inner.regions()
    }
}

impl tern_engine::DirtyLog for IncrementingGuest {
    fn start_dirty_log(&mut self) -> tern_engine::GuestResult<()> {
        self.inner.start_dirty_log()
    }

    fn sync_dirty_log(
        &mut self,
        bitmaps: &mut [tern_engine::DirtyBitmap],
    ) -> tern_engine::GuestResult<()> {
        self.inner.sync_dirty_log(bitmaps)?;
        let region = &self.inner.regions()[0];
        for page in 0..self.working_set_pages {
            let ptr = region.page_ptr(page).expect("inside the region");
            // SAFETY: the first byte of a page of the guest's own mapping;
            // the source reads pages only while an iteration is sent, never
            // during the dirty-log sync that calls this.
            unsafe { *ptr = (*ptr).wrapping_add(1) };
            bitmaps[0].set(page);
        }
        Ok(())
    }

    fn stop_dirty_log(&mut self) -> tern_engine::GuestResult<()> {
        self.inner.stop_dirty_log()
    }
}

impl tern_engine::GuestControl for IncrementingGuest {
    fn pause(&mut self) -> tern_engine::GuestResult<()> {
        self.inner.pause()
    }

    fn resume(&mut self) -> tern_engine::GuestResult<()> {
        self.inner.resume()
    }

    fn set_throttle(&mut self, percent: u8) -> tern_engine::GuestResult<()> {
        self.inner.set_throttle(percent)
    }
}

impl tern_engine::DeviceState for IncrementingGuest {
    fn save_state(&mut self) -> tern_engine::GuestResult<Vec<tern_engine::StateSection>> {
        self.inner.save_state()
    }

    fn restore_state(
        &mut self,
        sections: &[tern_engine::StateSection],
    ) -> tern_engine::GuestResult<()> {
        self.inner.restore_state(sections)
    }

    fn state_size_hint(&self) -> u64 {
        self.inner.state_size_hint()
    }

    fn guest_kind(&self) -> &str {
        self.inner.guest_kind()
    }
}

/// Migrates an [`IncrementingGuest`] of 64 MiB with a working set of 2048
/// pages under `auto` on a 64 MiB/s link, through iterations 0 to 3 and a
/// forced switch-over, checked by digest.
fn migrate_incrementing(
    configure: impl FnOnce(&mut tern_engine::MigrationConfig),
) -> tern_engine::MigrationStats {
    let mut guest = IncrementingGuest::new(64 * MIB, 2048);
    let (listener, address) = tcp_listener();
    let destination = spawn_destination(listener);
    let mut config = migration_config(2);
    config.compression = CodecChoice::Auto;
    config.max_bandwidth = Some(64 * MIB);
    // Never converges by itself: iterations 0 to 3 run, then the
    // switch-over is forced.
    config.downtime_limit = Duration::from_nanos(1);
    config.max_iterations = Some(4);
    config.limit_policy = tern_engine::LimitPolicy::SwitchOver;
    configure(&mut config);
    let stats = Source::new(config)
        .unwrap()
        .migrate(&mut guest, &address)
        .expect("migration");
    let received = join_within(destination, "the destination").expect("destination");
    assert_eq!(stats.status, MigrationStatus::Completed);
    assert!(stats.digest_verified);
    let mut arrived = received.guest;
    arrived.pause().unwrap();
    assert_eq!(arrived.digest(), guest.inner.digest());
    stats
}

#[test]
fn auto_reports_each_decision_with_its_reason_and_sizes_the_delta_cache() {
    let stats = migrate_incrementing(|_| {});
    let report = stats.compression.expect("compression report");
    let auto = report.auto.expect("auto's report");
    let subjects: Vec<&str> = auto.decisions.iter().map(|d| d.subject.as_str()).collect();
    // The dictionary (setup), the first codec (calibration), the delta
    // cache (at the start of iteration 1), each with a reason.
    assert_eq!(subjects[..2], ["dictionary", "codec"], "{auto:?}");
    assert!(auto.decisions.iter().all(|d| !d.reason.is_empty()));
    let delta = auto
        .decisions
        .iter()
        .find(|d| d.subject == "delta-cache")
        .unwrap_or_else(|| panic!("no delta-cache decision: {auto:?}"));
    // 2048 pages dirtied again, two slots each: 16 MiB, within the 32 MiB
    // (half of guest memory) allowed.
    assert_eq!(delta.choice, (16 * MIB).to_string(), "{delta:?}");
    assert!(delta.reason.contains("2048 pages"), "{delta:?}");
    let cache = stats.xbzrle_cache.expect("delta cache statistics");
    assert_eq!(cache.cache_size, 16 * MIB);
    // Iteration 1 caches the working set, 2 and 3 send it as deltas.
    assert!(cache.pages >= 2048, "{cache:?}");
}

#[test]
fn auto_leaves_the_delta_cache_off_without_an_allowance() {
    let stats = migrate_incrementing(|config| config.delta_cache_allowance = Some(0));
    let auto = stats.compression.unwrap().auto.unwrap();
    let delta = auto
        .decisions
        .iter()
        .find(|d| d.subject == "delta-cache")
        .unwrap_or_else(|| panic!("no delta-cache decision: {auto:?}"));
    assert_eq!(delta.choice, "off");
    assert!(stats.xbzrle_cache.is_none_or(|cache| cache.pages == 0));
}
