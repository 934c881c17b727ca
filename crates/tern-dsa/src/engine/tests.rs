//! The engine on the software device: answers, fallbacks, bounds,
//! timeouts, NUMA order and the completion thread's idle steps.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tern_page::{
    MAX_BATCH_PAGES, OffloadError, PAGE_SIZE, ZeroChecker, ZeroPageOffload, cpu_offload,
};

use super::completion::{IdleStep, SPIN_ROUNDS, idle_step};
use super::config::{DsaConfig, OffloadConfig};
use super::offload::DsaOffload;
use super::open::{open_dsa, select_queues, software_dsa};
use super::queues::NoRoom;
use crate::DsaError;
use crate::desc::STATUS_TRANSLATION_FAIL;
use crate::desc::{CompletionRecord, Descriptor};
use crate::queue::SubmissionMethod;
use crate::queue::{CpuSubmitFeatures, DsaQueue};
use crate::select::{DsaSelection, NumaPolicy};
use crate::soft::StallGate;
use crate::soft::{SoftwareDsa, SoftwareDsaConfig};
use crate::sysfs::{WorkQueueInfo, WqMode, discover_work_queues};

/// Page-aligned test pages; page i is non-zero when `nonzero(i)`, at a
/// byte that varies with i so every position class is covered.
struct Pages {
    storage: Vec<u8>,
    start: usize,
    n: usize,
}

impl Pages {
    fn new(n: usize, nonzero: impl Fn(usize) -> bool) -> Self {
        let storage = vec![0u8; (n + 1) * PAGE_SIZE];
        let start = storage.as_ptr().align_offset(PAGE_SIZE);
        let mut p = Pages { storage, start, n };
        for i in 0..n {
            if nonzero(i) {
                let pos = (i * 977) % PAGE_SIZE;
                p.storage[p.start + i * PAGE_SIZE + pos] = 0x5a;
            }
        }
        p
    }

    fn ptrs(&self) -> Vec<*const u8> {
        (0..self.n)
            .map(|i| self.storage[self.start + i * PAGE_SIZE..].as_ptr())
            .collect()
    }

    fn expected(&self) -> Vec<bool> {
        self.storage[self.start..self.start + self.n * PAGE_SIZE]
            .chunks_exact(PAGE_SIZE)
            .map(|p| p.iter().all(|&b| b == 0))
            .collect()
    }
}

fn check(off: &dyn ZeroPageOffload, pages: &Pages) -> Vec<bool> {
    let mut out = Vec::new();
    // SAFETY: `pages` outlives the wait.
    let t = unsafe { off.submit(&pages.ptrs()) }.unwrap();
    off.wait(t, &mut out).unwrap();
    assert_eq!(out, pages.expected());
    out
}

fn soft(cfg: SoftwareDsaConfig) -> Arc<dyn DsaQueue> {
    Arc::new(SoftwareDsa::new(cfg))
}

#[test]
fn all_zero_mixed_and_single() {
    let off = software_dsa(SoftwareDsaConfig::default());
    assert!(off.describe().starts_with("dsa [soft-dsa (software)]"));
    check(&*off, &Pages::new(128, |_| false));
    check(&*off, &Pages::new(128, |i| i % 3 == 0));
    check(&*off, &Pages::new(1, |_| false));
    check(&*off, &Pages::new(1, |_| true));
    check(&*off, &Pages::new(2, |i| i == 1));
    let s = off.stats();
    assert_eq!(s.pages_device, 128 + 128 + 1 + 1 + 2);
    assert_eq!(s.pages_fallback, 0);
    assert_eq!(s.batches, 5);
    // 128 pages at max batch 32 = 4 BATCH descriptors each; lone pages
    // go as one COMPVAL.
    assert_eq!(s.descriptors_submitted, 4 + 4 + 1 + 1 + 1);
    let mut out = vec![true];
    // SAFETY: no pages.
    let t = unsafe { off.submit(&[]) }.unwrap();
    off.wait(t, &mut out).unwrap();
    assert!(out.is_empty());
}

#[test]
fn batches_larger_than_max_are_split() {
    for max in [2, 3, 7, 127, 128] {
        let off = DsaOffload::new(
            vec![soft(SoftwareDsaConfig {
                max_batch_size: max,
                ..Default::default()
            })],
            OffloadConfig::default(),
        )
        .unwrap();
        check(&off, &Pages::new(128, |i| i % 5 == 1));
        check(&off, &Pages::new(5, |i| i == 4));
        let s = off.stats();
        assert_eq!(s.pages_device, 133, "max {max}");
        assert_eq!(
            s.descriptors_submitted,
            (128usize.div_ceil(max) + 5usize.div_ceil(max)) as u64
        );
    }
}

#[test]
fn write_path_submits_every_page_alone() {
    let off = DsaOffload::new(
        vec![soft(SoftwareDsaConfig {
            method: SubmissionMethod::Write,
            ..Default::default()
        })],
        OffloadConfig::default(),
    )
    .unwrap();
    check(&off, &Pages::new(40, |i| i % 2 == 0));
    assert_eq!(off.stats().descriptors_submitted, 40);
    assert!(off.describe().contains("(write)"));
}

#[test]
fn the_write_path_hands_a_batch_over_in_one_call() {
    let device = Arc::new(SoftwareDsa::new(SoftwareDsaConfig {
        method: SubmissionMethod::Write,
        ..Default::default()
    }));
    let off = DsaOffload::new(vec![device.clone()], OffloadConfig::default()).unwrap();
    check(&off, &Pages::new(40, |i| i % 2 == 0));
    check(&off, &Pages::new(7, |i| i == 3));
    assert_eq!(off.stats().descriptors_submitted, 47);
    assert_eq!(device.submit_calls(), 2, "one write() per batch");
}

#[test]
fn a_refusing_queue_is_backed_off_then_retired() {
    let refusing = || {
        Arc::new(SoftwareDsa::new(SoftwareDsaConfig {
            refuse_every: Some(1),
            ..Default::default()
        }))
    };
    // Backing off: after a refusal the queue is left alone for a while.
    let device = refusing();
    let off = DsaOffload::new(
        vec![device.clone()],
        OffloadConfig {
            refusal_backoff: Duration::from_secs(3600),
            ..Default::default()
        },
    )
    .unwrap();
    let pages = Pages::new(64, |i| i % 5 == 0);
    check(&off, &pages);
    assert_eq!(
        device.descriptors_offered(),
        1,
        "the rest of the batch is not offered"
    );
    check(&off, &pages);
    check(&off, &pages);
    assert_eq!(device.descriptors_offered(), 1, "skipped while backing off");
    let s = off.stats();
    assert_eq!(s.submit_failures, 1, "{s:?}");
    assert_eq!(s.pages_queue_full, 128, "{s:?}");
    assert_eq!(s.pages_fallback, 192, "{s:?}");
    // Retired: after `refusals_before_retire` refusals in a row it is never
    // offered anything again.
    let device = refusing();
    let off = DsaOffload::new(
        vec![device.clone()],
        OffloadConfig {
            refusal_backoff: Duration::ZERO,
            refusals_before_retire: 3,
            ..Default::default()
        },
    )
    .unwrap();
    for _ in 0..10 {
        check(&off, &pages);
    }
    assert_eq!(device.descriptors_offered(), 3);
    let s = off.stats();
    assert_eq!((s.queues_disabled, s.submit_failures), (1, 3), "{s:?}");
}

#[test]
fn a_queue_disabled_under_outstanding_work_is_noticed_through_its_fd() {
    // Every descriptor is accepted and lost, and the timeout is an hour:
    // only the disabled queue's fd (and its state) can finish the wait.
    let device = Arc::new(SoftwareDsa::new(SoftwareDsaConfig {
        lose_if: Some(Arc::new(|_, _| true)),
        ..Default::default()
    }));
    let off = DsaOffload::new(
        vec![device.clone()],
        OffloadConfig {
            completion_timeout: Duration::from_secs(3600),
            ..Default::default()
        },
    )
    .unwrap();
    let pages = Pages::new(64, |i| i % 3 == 0);
    // SAFETY: `pages` outlives the wait.
    let ticket = unsafe { off.submit(&pages.ptrs()) }.unwrap();
    assert!(!off.is_done(&ticket));
    device.disable();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !off.is_done(&ticket) {
        assert!(
            Instant::now() < deadline,
            "the disabled queue was never noticed"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut out = Vec::new();
    off.wait(ticket, &mut out).unwrap();
    assert_eq!(out, pages.expected());
    let s = off.stats();
    assert_eq!((s.queues_disabled, s.slots_retired), (1, 1), "{s:?}");
    // Nothing more goes to it.
    check(&off, &pages);
    assert_eq!(off.stats().descriptors_submitted, s.descriptors_submitted);
}

#[test]
fn page_faults_are_finished_on_the_cpu() {
    // Fault on every third descriptor, after 1000 bytes: a page whose
    // only non-zero byte lies beyond that must still be reported
    // non-zero, and one before it is found by the device.
    let off = DsaOffload::new(
        vec![soft(SoftwareDsaConfig {
            fault_if: Some(Arc::new(|n, _| n % 3 == 0)),
            fault_after_bytes: 1000,
            ..Default::default()
        })],
        OffloadConfig::default(),
    )
    .unwrap();
    let pages = Pages::new(96, |i| i % 2 == 0);
    check(&off, &pages);
    let s = off.stats();
    assert!(s.page_faults > 0, "{s:?}");
    assert_eq!(s.pages_fallback, s.page_faults);
    assert_eq!(s.pages_device + s.pages_fallback, 96);
    assert_eq!(s.device_errors, 0, "faults are not device errors");
}

#[test]
fn device_errors_fall_back_then_disable_the_queue() {
    let off = DsaOffload::new(
        vec![soft(SoftwareDsaConfig {
            error_if: Some(Arc::new(|n, _| n % 10 == 0)),
            error_status: STATUS_TRANSLATION_FAIL,
            ..Default::default()
        })],
        OffloadConfig {
            error_threshold: 2,
            ..Default::default()
        },
    )
    .unwrap();
    let pages = Pages::new(64, |i| i % 4 == 3);
    // Each submission hits descriptors 10, 20, ... so every one errs.
    check(&off, &pages);
    let s = off.stats();
    assert_eq!(s.device_errors, 1);
    assert!(s.pages_fallback >= 6, "{s:?}");
    assert_eq!(s.queues_disabled, 0);
    check(&off, &pages);
    assert_eq!(off.stats().queues_disabled, 1);
    // Disabled: everything on the CPU, still correct.
    let before = off.stats();
    check(&off, &pages);
    let after = off.stats();
    assert_eq!(after.pages_fallback - before.pages_fallback, 64);
    assert_eq!(after.pages_device, before.pages_device);
}

#[test]
fn refused_submissions_fall_back() {
    let off = DsaOffload::new(
        vec![soft(SoftwareDsaConfig {
            refuse_every: Some(2),
            max_batch_size: 16,
            ..Default::default()
        })],
        OffloadConfig::default(),
    )
    .unwrap();
    check(&off, &Pages::new(128, |i| i % 7 == 0));
    // The first chunk goes, the second is refused, and the rest of the
    // batch is checked on the CPU without being offered.
    let s = off.stats();
    assert_eq!(s.submit_failures, 1, "{s:?}");
    assert_eq!(s.pages_fallback, 112);
    assert_eq!(s.pages_device, 16);
}

#[test]
fn delays_still_correct_and_completion_cpu_measured() {
    let off = DsaOffload::new(
        vec![soft(SoftwareDsaConfig {
            delay_per_descriptor: Duration::from_micros(200),
            ..Default::default()
        })],
        OffloadConfig::default(),
    )
    .unwrap();
    let a = Pages::new(64, |i| i % 2 == 1);
    let b = Pages::new(64, |_| false);
    let mut out = Vec::new();
    // SAFETY: pages outlive the waits.
    let (ta, tb) = unsafe {
        (
            off.submit(&a.ptrs()).unwrap(),
            off.submit(&b.ptrs()).unwrap(),
        )
    };
    // Whether `tb` is still pending here depends on how long this thread
    // was descheduled since the submit, so only the outcome is checked.
    off.wait(tb, &mut out).unwrap();
    assert_eq!(out, b.expected());
    assert!(off.is_done(&ta), "FIFO device: a finished before b");
    off.wait(ta, &mut out).unwrap();
    assert_eq!(out, a.expected());
    // The completion thread publishes its CPU time after each batch.
    let s = off.stats();
    assert!(s.completion_thread_cpu > Duration::ZERO, "{s:?}");
    assert!(s.completion_cpu_per_gib().is_some());
}

#[test]
fn concurrent_workers_share_two_devices_round_robin() {
    let devs: Vec<Arc<SoftwareDsa>> = (0..2)
        .map(|i| {
            Arc::new(SoftwareDsa::new(SoftwareDsaConfig {
                name: format!("soft{i}"),
                queue_depth: 8,
                ..Default::default()
            }))
        })
        .collect();
    let queues: Vec<Arc<dyn DsaQueue>> = devs
        .iter()
        .map(|d| d.clone() as Arc<dyn DsaQueue>)
        .collect();
    let off = Arc::new(
        DsaOffload::new(
            queues,
            OffloadConfig {
                slots: 16,
                ..Default::default()
            },
        )
        .unwrap(),
    );
    let pages = Arc::new(Pages::new(128, |i| i % 3 == 2));
    let workers: Vec<_> = (0..4)
        .map(|w| {
            let off = off.clone();
            let pages = pages.clone();
            std::thread::spawn(move || {
                let ptrs = pages.ptrs();
                let want = pages.expected();
                let mut out = Vec::new();
                for round in 0..25 {
                    let n = 1 + (w * 31 + round * 17) % 128;
                    // Two in flight per worker.
                    // SAFETY: pages outlive the waits.
                    let t1 = unsafe { off.submit(&ptrs[..n]) }.unwrap();
                    // SAFETY: as above.
                    let t2 = unsafe { off.submit(&ptrs[128 - n..]) }.unwrap();
                    off.wait(t1, &mut out).unwrap();
                    assert_eq!(out, want[..n]);
                    off.wait(t2, &mut out).unwrap();
                    assert_eq!(out, want[128 - n..]);
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    let s = off.stats();
    let total: usize = (0..4)
        .flat_map(|w| (0..25).map(move |r| 2 * (1 + (w * 31 + r * 17) % 128)))
        .sum();
    assert_eq!(s.pages_checked(), total as u64);
    // A submission whose every chunk was refused (queue full) counts in
    // neither.
    assert!(
        s.batches > 0 && s.batches + s.slots_exhausted <= 200,
        "{s:?}"
    );
    let (a, b) = (devs[0].compval_executed(), devs[1].compval_executed());
    assert!(a > 0 && b > 0, "both devices used: {a} / {b}");
    assert_eq!(a + b, s.pages_device);
}

#[test]
fn bad_tickets_and_too_many_pages() {
    let a = software_dsa(SoftwareDsaConfig::default());
    let b = cpu_offload(ZeroChecker::best());
    let pages = Pages::new(3, |_| false);
    let mut out = Vec::new();
    // SAFETY: pages outlive the waits.
    let t = unsafe { a.submit(&pages.ptrs()) }.unwrap();
    assert!(matches!(b.wait(t, &mut out), Err(OffloadError::BadTicket)));
    let too_many = vec![pages.ptrs()[0]; MAX_BATCH_PAGES + 1];
    // SAFETY: rejected before any page is read.
    let r = unsafe { a.submit(&too_many) };
    assert!(matches!(r, Err(OffloadError::TooManyPages(129))));
    // SAFETY: as above.
    assert!(unsafe { b.submit(&too_many) }.is_err());
}

#[test]
fn slot_exhaustion_answers_on_the_cpu() {
    let off = DsaOffload::new(
        vec![soft(SoftwareDsaConfig {
            delay_per_descriptor: Duration::from_millis(2),
            ..Default::default()
        })],
        OffloadConfig {
            slots: 1,
            ..Default::default()
        },
    )
    .unwrap();
    let pages = Pages::new(4, |i| i == 0);
    let mut out = Vec::new();
    // SAFETY: pages outlive the waits.
    let t1 = unsafe { off.submit(&pages.ptrs()) }.unwrap();
    // SAFETY: as above.
    let t2 = unsafe { off.submit(&pages.ptrs()) }.unwrap();
    assert!(off.is_done(&t2), "answered on the CPU at once");
    off.wait(t2, &mut out).unwrap();
    assert_eq!(out, pages.expected());
    off.wait(t1, &mut out).unwrap();
    assert_eq!(out, pages.expected());
    assert_eq!(off.stats().slots_exhausted, 1);
}

#[test]
fn open_dsa_errors_are_clear() {
    let t = tempfile::tempdir().unwrap();
    let cfg = DsaConfig {
        sysfs_root: t.path().join("sys/bus/dsa"),
        dev_root: t.path().join("dev/dsa"),
        ..Default::default()
    };
    let err = open_dsa(&cfg).unwrap_err().to_string();
    assert!(err.starts_with("no DSA work queue found in"), "{err}");
    assert!(err.contains("accel-config"), "{err}");
    crate::sysfs::tests::fake_wq(
        &cfg.sysfs_root,
        true,
        0,
        0,
        "enabled",
        "user",
        "dedicated",
        32,
    );
    let err = open_dsa(&cfg).unwrap_err().to_string();
    assert!(
        err.contains("could be opened") && err.contains("wq0.0"),
        "{err}"
    );
    let only = DsaConfig {
        devices: "dsa1/wq1.0".parse().unwrap(),
        ..cfg
    };
    let err = open_dsa(&only).unwrap_err();
    assert!(matches!(err, DsaError::NoMatch { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("dsa1/wq1.0") && msg.contains("found: dsa0/wq0.0"),
        "{msg}"
    );
}

#[test]
fn shared_queues_are_preferred_and_the_selection_is_honoured() {
    let t = tempfile::tempdir().unwrap();
    let cfg = DsaConfig {
        sysfs_root: t.path().join("sys/bus/dsa"),
        dev_root: t.path().join("dev/dsa"),
        ..Default::default()
    };
    let fake = crate::sysfs::tests::fake_wq;
    fake(
        &cfg.sysfs_root,
        true,
        0,
        0,
        "enabled",
        "user",
        "dedicated",
        32,
    );
    fake(&cfg.sysfs_root, true, 0, 1, "enabled", "user", "shared", 32);
    fake(
        &cfg.sysfs_root,
        true,
        2,
        1,
        "enabled",
        "user",
        "dedicated",
        32,
    );
    // Regular files stand in for the device nodes: they open, and with
    // no portal instruction used (nothing is submitted) that is enough.
    std::fs::create_dir_all(&cfg.dev_root).unwrap();
    for q in ["wq0.0", "wq0.1", "wq2.1"] {
        std::fs::write(cfg.dev_root.join(q), b"").unwrap();
    }
    let found = discover_work_queues(&cfg.sysfs_root, &cfg.dev_root).unwrap();
    let order: Vec<String> = select_queues(&found, &DsaSelection::all())
        .unwrap()
        .iter()
        .map(WorkQueueInfo::full_name)
        .collect();
    assert_eq!(order, ["dsa0/wq0.1", "dsa0/wq0.0", "dsa2/wq2.1"]);
    // Whole host: the shared queue only, dedicated ones left to others.
    let off = open_dsa(&cfg).unwrap();
    let d = off.describe();
    assert!(
        d.contains("dsa0/wq0.1") && !d.contains("wq0.0") && !d.contains("wq2.1"),
        "{d}"
    );
    // A list: exactly what it names, dedicated or not.
    let listed = DsaConfig {
        devices: "dsa2,dsa0/wq0.0".parse().unwrap(),
        ..cfg.clone()
    };
    let d = open_dsa(&listed).unwrap().describe();
    assert!(
        d.contains("dsa0/wq0.0") && d.contains("dsa2/wq2.1") && !d.contains("wq0.1"),
        "{d}"
    );
}

/// A software device whose first COMPVAL holds it until the gate opens.
fn stalled_device(
    depth: usize,
    max_batch: usize,
    mode: WqMode,
) -> (Arc<SoftwareDsa>, Arc<StallGate>) {
    let gate = Arc::new(StallGate::default());
    let dev = Arc::new(SoftwareDsa::new(SoftwareDsaConfig {
        mode,
        method: if mode == WqMode::Dedicated {
            SubmissionMethod::Movdir64b
        } else {
            SubmissionMethod::Enqcmd
        },
        queue_depth: depth,
        max_batch_size: max_batch,
        stall_if: Some(Arc::new(|n, _| n == 1)),
        stall_gate: gate.clone(),
        ..Default::default()
    }));
    (dev, gate)
}

#[test]
fn a_dedicated_queue_is_never_overfilled_and_would_drop_without_the_bound() {
    for bounded in [true, false] {
        // The device holds its first descriptor until the gate opens, so
        // the queue stays as full as the submissions make it.
        let (dev, gate) = stalled_device(4, 2, WqMode::Dedicated);
        let off = DsaOffload::with_bound(
            vec![dev.clone() as Arc<dyn DsaQueue>],
            OffloadConfig {
                // Bounded: nothing may time out, even on a loaded
                // machine. Unbounded: the dropped descriptors must.
                completion_timeout: Duration::from_millis(if bounded { 60_000 } else { 200 }),
                ..Default::default()
            },
            bounded,
        )
        .unwrap();
        let pages = Pages::new(16, |i| i % 3 == 0);
        // 16 pages at max batch 2 = 8 BATCH descriptors: twice the queue.
        // SAFETY: pages outlive the wait.
        let t = unsafe { off.submit(&pages.ptrs()) }.unwrap();
        if bounded {
            assert_eq!(dev.dropped(), 0, "bounded: nothing dropped");
        } else {
            assert_eq!(dev.dropped(), 4, "unbounded: the overfill is dropped");
        }
        gate.open();
        let mut out = Vec::new();
        off.wait(t, &mut out).unwrap();
        assert_eq!(out, pages.expected(), "bounded {bounded}");
        let s = off.stats();
        if bounded {
            assert_eq!(s.pages_device, 8, "{s:?}");
            assert_eq!(s.pages_queue_full, 8, "{s:?}");
            assert_eq!(s.pages_fallback, 8, "{s:?}");
            assert_eq!(s.device_errors, 0, "{s:?}");
            assert!(dev.peak_occupancy() <= 4);
        } else {
            assert_eq!(s.device_errors, 1, "{s:?}");
            assert_eq!(s.slots_retired, 1, "{s:?}");
        }
    }
}

#[test]
fn a_full_shared_queue_refuses_instead_of_dropping() {
    let (dev, gate) = stalled_device(4, 2, WqMode::Shared);
    let off = DsaOffload::with_bound(
        vec![dev.clone() as Arc<dyn DsaQueue>],
        OffloadConfig {
            completion_timeout: Duration::from_secs(60),
            ..Default::default()
        },
        false,
    )
    .unwrap();
    let pages = Pages::new(16, |i| i % 4 == 1);
    // SAFETY: pages outlive the wait.
    let t = unsafe { off.submit(&pages.ptrs()) }.unwrap();
    gate.open();
    let mut out = Vec::new();
    off.wait(t, &mut out).unwrap();
    assert_eq!(out, pages.expected());
    assert_eq!(dev.dropped(), 0);
    let s = off.stats();
    // The first refusal ends the offering: the rest is checked on the CPU.
    assert_eq!(s.submit_failures, 1, "{s:?}");
    assert_eq!(s.device_errors, 0, "{s:?}");
}

#[test]
fn write_path_on_a_small_dedicated_queue_checks_the_rest_on_the_cpu() {
    let dev = Arc::new(SoftwareDsa::new(SoftwareDsaConfig {
        mode: WqMode::Dedicated,
        method: SubmissionMethod::Write,
        queue_depth: 32,
        ..Default::default()
    }));
    let off = DsaOffload::new(
        vec![dev.clone() as Arc<dyn DsaQueue>],
        OffloadConfig::default(),
    )
    .unwrap();
    for _ in 0..3 {
        check(&off, &Pages::new(128, |i| i % 9 == 4));
    }
    let s = off.stats();
    assert_eq!(dev.dropped(), 0);
    assert_eq!(s.pages_device, 3 * 32, "{s:?}");
    assert_eq!(s.pages_queue_full, 3 * 96, "{s:?}");
    assert_eq!(s.descriptors_submitted, 3 * 32);
}

#[test]
fn a_lost_descriptor_times_out_on_the_clock_while_others_complete() {
    let lossy = Arc::new(SoftwareDsa::new(SoftwareDsaConfig {
        name: "lossy".into(),
        lose_if: Some(Arc::new(|k, _| k == 1)),
        ..Default::default()
    }));
    let healthy = soft(SoftwareDsaConfig {
        name: "healthy".into(),
        ..Default::default()
    });
    let off = DsaOffload::new(
        vec![lossy.clone() as Arc<dyn DsaQueue>, healthy],
        OffloadConfig {
            completion_timeout: Duration::from_secs(1),
            ..Default::default()
        },
    )
    .unwrap();
    let pages = Pages::new(8, |i| i == 5);
    // Round-robin starts at the lossy queue.
    // SAFETY: pages outlive the waits.
    let lost = unsafe { off.submit(&pages.ptrs()) }.unwrap();
    assert_eq!(lossy.lost(), 1);
    // Completions keep flowing on both queues meanwhile: the lost one
    // must still give up on its own clock, not when polling goes idle.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !off.is_done(&lost) {
        assert!(
            Instant::now() < deadline,
            "the lost submission never timed out"
        );
        check(&off, &pages);
    }
    let mut out = Vec::new();
    off.wait(lost, &mut out).unwrap();
    assert_eq!(out, pages.expected());
    // At least the lost one; on a machine loaded enough to delay a
    // healthy batch past the timeout too, that one is retired as well.
    let s = off.stats();
    assert!(s.device_errors >= 1, "{s:?}");
    assert!(s.slots_retired >= 1, "{s:?}");
    assert!(s.queues_disabled >= 1, "the lossy queue is retired: {s:?}");
    let before = lossy.compval_executed();
    check(&off, &pages);
    check(&off, &pages);
    assert_eq!(lossy.compval_executed(), before, "nothing more to it");
}

#[test]
fn a_stalled_submission_is_retired_and_its_late_completion_is_harmless() {
    let (dev, gate) = stalled_device(128, 32, WqMode::Shared);
    let off = DsaOffload::new(
        vec![dev.clone() as Arc<dyn DsaQueue>],
        OffloadConfig {
            slots: 2,
            completion_timeout: Duration::from_millis(100),
            ..Default::default()
        },
    )
    .unwrap();
    let pages = Pages::new(64, |i| i % 2 == 0);
    // SAFETY: pages outlive the wait.
    let stalled = unsafe { off.submit(&pages.ptrs()) }.unwrap();
    let mut out = Vec::new();
    // Returns once the timeout has passed, answered on the CPU.
    off.wait(stalled, &mut out).unwrap();
    assert_eq!(out, pages.expected());
    let s = off.stats();
    assert_eq!((s.slots_retired, s.queues_disabled), (1, 1), "{s:?}");
    assert_eq!(off.inner.free.len(), 1, "the retired slot is not free");
    // The device wakes up and writes its records late, into the retired
    // slot; a NOOP behind them (FIFO) says when it is done.
    gate.open();
    let rec = Box::new(CompletionRecord::default());
    let noop = Descriptor::noop(&*rec as *const CompletionRecord as u64);
    // SAFETY: the record outlives the poll below.
    unsafe { dev.submit(&noop) }.unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    // SAFETY: a live record.
    while unsafe { CompletionRecord::load_status(&*rec) } == 0 {
        assert!(Instant::now() < deadline, "the device never finished");
        std::thread::yield_now();
    }
    assert_eq!(dev.compval_executed(), 64, "the stalled batch ran late");
    for _ in 0..4 {
        check(&off, &pages);
    }
    assert_eq!(off.inner.free.len(), 1, "still never reused");
}

#[test]
fn numa_local_queues_first_then_all() {
    let on_node = |name: &str, node| {
        soft(SoftwareDsaConfig {
            name: name.into(),
            numa_node: Some(node),
            queue_depth: 4,
            ..Default::default()
        })
    };
    let off = DsaOffload::new(
        vec![on_node("n0", 0), on_node("n1", 1)],
        OffloadConfig::default(),
    )
    .unwrap();
    let inner = &off.inner;
    assert!(inner.queues.numa_matters);
    // 32 pages = one chunk; node 1's queue takes four, then is full.
    for _ in 0..4 {
        assert_eq!(inner.queues.pick(32, Some(1)).unwrap().queue, 1);
    }
    assert_eq!(
        inner.queues.pick(32, Some(1)).unwrap().queue,
        0,
        "fall back"
    );
    assert_eq!(inner.queues.pick(32, Some(0)).unwrap().queue, 0);
    // Partial room: two chunks left on node 0, a four-chunk batch gets
    // its head there.
    let r = inner.queues.pick(128, Some(0)).unwrap();
    assert_eq!((r.queue, r.chunks, r.pages), (0, 2, 64));
    assert_eq!(inner.queues.pick(1, Some(0)), Err(NoRoom::Full));
    // Unknown node, or the Any policy: round-robin over both.
    let any = DsaOffload::new(
        vec![on_node("a0", 0), on_node("a1", 1)],
        OffloadConfig {
            numa: NumaPolicy::Any,
            ..Default::default()
        },
    )
    .unwrap();
    assert!(!any.inner.queues.numa_matters);
    let picked: Vec<usize> = (0..4)
        .map(|_| any.inner.queues.pick(32, Some(1)).unwrap().queue)
        .collect();
    assert_eq!(picked, [0, 1, 0, 1]);
}

#[test]
fn completion_thread_waits_with_umwait_only_where_waitpkg_exists() {
    use IdleStep::*;
    assert_eq!(idle_step(0, true), Spin);
    assert_eq!(idle_step(SPIN_ROUNDS - 1, true), Spin);
    assert_eq!(idle_step(SPIN_ROUNDS, true), Umwait);
    assert_eq!(idle_step(SPIN_ROUNDS, false), Yield);
    assert_eq!(idle_step(u32::MAX, false), Yield);
    let waitpkg = CpuSubmitFeatures::detect().waitpkg;
    let on = DsaOffload::new(vec![soft(Default::default())], OffloadConfig::default()).unwrap();
    assert_eq!(on.inner.umwait_available, waitpkg);
    let off = DsaOffload::new(
        vec![soft(Default::default())],
        OffloadConfig {
            umwait: false,
            ..Default::default()
        },
    )
    .unwrap();
    assert!(!off.inner.umwait_available);
    check(&off, &Pages::new(64, |i| i == 3));
    assert_eq!(off.stats().umwaits, 0);
}

#[test]
fn the_delta_offload_shares_the_zero_page_queues_and_their_bound() {
    use tern_page::DeltaOffload;
    use tern_page::delta::MAX_DELTA_LEN;

    use crate::delta::{DELTA_DEADLINE, DsaDeltaOffload};

    // A dedicated queue of two places, held by a stalled zero-page batch.
    let (dev, gate) = stalled_device(2, 32, WqMode::Dedicated);
    let engine = Arc::new(
        DsaOffload::new(
            vec![dev.clone() as Arc<dyn DsaQueue>],
            OffloadConfig::default(),
        )
        .unwrap(),
    );
    let delta = DsaDeltaOffload::sharing(engine.clone(), DELTA_DEADLINE);
    let pages = Pages::new(3, |i| i == 1);
    // Three pages, one chunk: one place taken; a second batch takes the other.
    // SAFETY: `pages` outlives the waits.
    let first = unsafe { engine.submit(&pages.ptrs()) }.unwrap();
    // SAFETY: as above.
    let second = unsafe { engine.submit(&pages.ptrs()) }.unwrap();
    let offered = dev.descriptors_offered();
    assert_eq!(offered, 2);
    let old = [7u8; PAGE_SIZE];
    let mut new = old;
    new[100] = 1;
    let mut out = [0u8; MAX_DELTA_LEN];
    // The queue is full: the delta is made on the CPU, nothing is offered
    // (a third descriptor would be dropped by the dedicated queue).
    assert!(delta.create(&old, &new, &mut out).is_some());
    assert_eq!(dev.descriptors_offered(), offered);
    assert_eq!(delta.stats().fallbacks, 1);
    assert_eq!(dev.dropped(), 0);
    gate.open();
    let mut answers = Vec::new();
    engine.wait(first, &mut answers).unwrap();
    engine.wait(second, &mut answers).unwrap();
    assert_eq!(answers, pages.expected());
    // Room again: the same queue (no second open) makes the record.
    assert!(delta.create(&old, &new, &mut out).is_some());
    assert_eq!(delta.stats().on_device, 1);
    assert_eq!(dev.descriptors_offered(), offered + 1);
    assert_eq!(dev.dropped(), 0);
}
