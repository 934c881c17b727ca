//! A benchmark knob of the pipeline (`MigrationConfig::zero_page_as_normal`,
//! like the seed's normal-page ratio): a share of the zero pages is sent as
//! normal pages, so benchmarks can load the network with a known amount of
//! payload whatever the guest's content.

use std::sync::atomic::{AtomicU64, Ordering};

/// Demotes a share of zero pages to normal pages. Deterministic and
/// lock-free: of every 1000 zero pages seen, exactly `per_mille` are
/// demoted, spread evenly.
#[derive(Debug)]
pub(crate) struct ZeroAsNormal {
    per_mille: u64,
    seen: AtomicU64,
}

impl ZeroAsNormal {
    /// `ratio` in 0.0..=1.0 (clamped): the share of zero pages to send as
    /// normal pages.
    pub(crate) fn new(ratio: f64) -> Self {
        #[expect(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            reason = "a value in 0.0..=1000.0 with no fraction"
        )]
        let per_mille = (ratio.clamp(0.0, 1.0) * 1000.0).round() as u64;
        ZeroAsNormal {
            per_mille,
            seen: AtomicU64::new(0),
        }
    }

    /// Called for each zero page; true = send it as a normal page.
    pub(crate) fn demote(&self) -> bool {
        if self.per_mille == 0 {
            return false;
        }
        let n = self.seen.fetch_add(1, Ordering::Relaxed);
        (n + 1) * self.per_mille / 1000 != n * self.per_mille / 1000
    }
}

#[cfg(test)]
mod tests {
    use super::ZeroAsNormal;

    #[test]
    fn zero_as_normal_ratio() {
        for (ratio, want) in [(0.0, 0), (0.25, 250), (0.5, 500), (1.0, 1000)] {
            let k = ZeroAsNormal::new(ratio);
            let n = (0..1000).filter(|_| k.demote()).count();
            assert_eq!(n, want, "ratio {ratio}");
        }
        let k = ZeroAsNormal::new(0.5);
        let first: Vec<bool> = (0..4).map(|_| k.demote()).collect();
        assert_eq!(first, [false, true, false, true], "spread evenly");
    }
}
