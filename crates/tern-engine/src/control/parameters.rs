//! Parameters an operator may change while a migration runs, with QEMU's
//! `migrate-set-parameters` names: a patch type for requests
//! ([`MigrationParameters`]) and the atomics the migration reads at its next
//! window ([`LiveParameters`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::MigrationConfig;

/// Longest downtime limit accepted: QEMU's (2000 s).
pub const MAX_DOWNTIME_LIMIT_MS: u64 = 2_000_000;

/// A set of parameters, each optional: in a request, the ones to change;
/// from [`crate::control::MigrationHandle::parameters`], all of them.
///
/// The names are QEMU's `migrate-set-parameters` ones, plus `auto-converge`
/// (a capability in QEMU, a parameter here because it may change while the
/// migration runs).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
#[non_exhaustive]
pub struct MigrationParameters {
    /// Cap on the bytes per second written to all channels together; 0
    /// removes the cap. Takes effect from the next packet.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub max_bandwidth: Option<u64>,
    /// Largest acceptable downtime, in milliseconds (1 to 2 000 000).
    /// Takes effect at the next dirty-log sync.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub downtime_limit: Option<u64>,
    /// Throttle the guest when it dirties memory faster than it is sent;
    /// turning it off removes the throttle at the next sync.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub auto_converge: Option<bool>,
    /// Throttle auto-converge applies first, in percent (1 to 99).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub cpu_throttle_initial: Option<u8>,
    /// Throttle auto-converge adds each further time, in percent (1 to 99).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub cpu_throttle_increment: Option<u8>,
    /// Highest throttle auto-converge applies, in percent (1 to 99).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub max_cpu_throttle: Option<u8>,
}

/// A parameter value out of its range.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("Parameter '{name}' {reason}")]
#[non_exhaustive]
pub struct ParameterError {
    /// The parameter's name as in [`MigrationParameters`]' JSON.
    pub name: &'static str,
    /// What is wrong with the value.
    pub reason: String,
}

impl MigrationParameters {
    /// Checks every value given; nothing is applied when one is wrong.
    pub fn validate(&self) -> Result<(), ParameterError> {
        if let Some(limit) = self.downtime_limit
            && !(1..=MAX_DOWNTIME_LIMIT_MS).contains(&limit)
        {
            return Err(ParameterError {
                name: "downtime-limit",
                reason: format!("must be 1 to {MAX_DOWNTIME_LIMIT_MS} ms, not {limit}"),
            });
        }
        for (name, value) in [
            ("cpu-throttle-initial", self.cpu_throttle_initial),
            ("cpu-throttle-increment", self.cpu_throttle_increment),
            ("max-cpu-throttle", self.max_cpu_throttle),
        ] {
            if let Some(percent) = value
                && !(1..=99).contains(&percent)
            {
                return Err(ParameterError {
                    name,
                    reason: format!("must be 1 to 99 (percent), not {percent}"),
                });
            }
        }
        Ok(())
    }

    /// Whether no parameter is given.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

/// The convergence settings in force, as the source reads them at a sync.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ConvergenceSettings {
    pub downtime_limit: Duration,
    pub auto_converge: bool,
    pub throttle_initial: u8,
    pub throttle_increment: u8,
    pub max_throttle: u8,
}

/// The parameters a running migration reads: atomics any thread may set.
#[derive(Debug)]
pub(crate) struct LiveParameters {
    /// Bytes per second, 0 for no cap; shared with the pipeline's limiter.
    max_bandwidth: Arc<AtomicU64>,
    downtime_limit_ms: AtomicU64,
    auto_converge: AtomicBool,
    throttle_initial: AtomicU8,
    throttle_increment: AtomicU8,
    max_throttle: AtomicU8,
    switch_over_requested: AtomicBool,
}

impl LiveParameters {
    pub(crate) fn new(config: &MigrationConfig) -> Self {
        Self {
            max_bandwidth: Arc::new(AtomicU64::new(config.max_bandwidth.unwrap_or(0))),
            downtime_limit_ms: AtomicU64::new(
                u64::try_from(config.downtime_limit.as_millis()).unwrap_or(u64::MAX),
            ),
            auto_converge: AtomicBool::new(config.auto_converge),
            throttle_initial: AtomicU8::new(config.throttle_initial),
            throttle_increment: AtomicU8::new(config.throttle_increment),
            max_throttle: AtomicU8::new(99),
            switch_over_requested: AtomicBool::new(false),
        }
    }

    /// Applies a validated patch.
    pub(crate) fn apply(&self, patch: &MigrationParameters) -> Result<(), ParameterError> {
        patch.validate()?;
        let set_u8 = |atomic: &AtomicU8, value: Option<u8>| {
            if let Some(value) = value {
                atomic.store(value, Ordering::Relaxed);
            }
        };
        if let Some(bandwidth) = patch.max_bandwidth {
            self.max_bandwidth.store(bandwidth, Ordering::Relaxed);
        }
        if let Some(limit) = patch.downtime_limit {
            self.downtime_limit_ms.store(limit, Ordering::Relaxed);
        }
        if let Some(on) = patch.auto_converge {
            self.auto_converge.store(on, Ordering::Relaxed);
        }
        set_u8(&self.throttle_initial, patch.cpu_throttle_initial);
        set_u8(&self.throttle_increment, patch.cpu_throttle_increment);
        set_u8(&self.max_throttle, patch.max_cpu_throttle);
        Ok(())
    }

    /// Every parameter's current value.
    pub(crate) fn current(&self) -> MigrationParameters {
        let settings = self.convergence();
        MigrationParameters {
            max_bandwidth: Some(self.max_bandwidth.load(Ordering::Relaxed)),
            downtime_limit: Some(
                u64::try_from(settings.downtime_limit.as_millis()).unwrap_or(u64::MAX),
            ),
            auto_converge: Some(settings.auto_converge),
            cpu_throttle_initial: Some(settings.throttle_initial),
            cpu_throttle_increment: Some(settings.throttle_increment),
            max_cpu_throttle: Some(settings.max_throttle),
        }
    }

    /// The bandwidth cap the pipeline's senders read before each packet.
    pub(crate) fn bandwidth_cap(&self) -> Arc<AtomicU64> {
        self.max_bandwidth.clone()
    }

    pub(crate) fn convergence(&self) -> ConvergenceSettings {
        ConvergenceSettings {
            downtime_limit: Duration::from_millis(self.downtime_limit_ms.load(Ordering::Relaxed)),
            auto_converge: self.auto_converge.load(Ordering::Relaxed),
            throttle_initial: self.throttle_initial.load(Ordering::Relaxed),
            throttle_increment: self.throttle_increment.load(Ordering::Relaxed),
            max_throttle: self.max_throttle.load(Ordering::Relaxed),
        }
    }

    pub(crate) fn request_switch_over(&self) {
        self.switch_over_requested.store(true, Ordering::Relaxed);
    }

    pub(crate) fn switch_over_requested(&self) -> bool {
        self.switch_over_requested.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::{LiveParameters, MigrationParameters};
    use crate::config::MigrationConfig;

    #[test]
    fn a_patch_changes_only_what_it_names() {
        let live = LiveParameters::new(&MigrationConfig::default());
        let before = live.current();
        live.apply(&MigrationParameters {
            downtime_limit: Some(900),
            ..MigrationParameters::default()
        })
        .unwrap();
        let after = live.current();
        assert_eq!(after.downtime_limit, Some(900));
        assert_eq!(after.max_bandwidth, before.max_bandwidth);
        assert_eq!(after.auto_converge, before.auto_converge);
    }

    #[test]
    fn a_bad_value_changes_nothing_and_is_named() {
        let live = LiveParameters::new(&MigrationConfig::default());
        let before = live.current();
        let error = live
            .apply(&MigrationParameters {
                max_bandwidth: Some(5),
                cpu_throttle_initial: Some(100),
                ..MigrationParameters::default()
            })
            .unwrap_err();
        assert_eq!(error.name, "cpu-throttle-initial");
        assert_eq!(live.current(), before);
        let error = MigrationParameters {
            downtime_limit: Some(0),
            ..MigrationParameters::default()
        }
        .validate()
        .unwrap_err();
        assert!(error.to_string().contains("downtime-limit"), "{error}");
    }

    #[test]
    fn unknown_names_are_refused_when_parsed() {
        let error = serde_json::from_str::<MigrationParameters>(r#"{"max-bandwith": 5}"#)
            .unwrap_err()
            .to_string();
        assert!(error.contains("max-bandwith"), "{error}");
    }
}
