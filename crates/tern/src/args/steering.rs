//! The options that let a script steer and watch a command from outside
//! (applied by `crate::steering`).

use std::path::PathBuf;

use clap::Args;

#[derive(Debug, Args, Default)]
pub(crate) struct SteeringArgs {
    /// A Unix socket (created mode 0600) speaking a QMP-shaped JSON
    /// protocol: query-migrate, migrate-set-parameters, migrate_cancel, ...
    /// (`tern ctl`; docs/control.md).
    #[arg(long, value_name = "PATH")]
    pub control_socket: Option<PathBuf>,
    /// Serve the migration's figures in the Prometheus text format on
    /// HOST:PORT (`GET /metrics`), named after KubeVirt's migration
    /// metrics (docs/control.md).
    #[arg(long, value_name = "HOST:PORT")]
    pub metrics_listen: Option<String>,
    /// Join the host's agent (`tern agent --socket PATH`): wait for a slot,
    /// take the agent's share of its bandwidth budget, follow its policy
    /// (docs/fleet.md).
    #[arg(long, value_name = "PATH")]
    pub agent: Option<PathBuf>,
    /// The name the agent lists this migration under (a VM's name;
    /// tern-PID by default).
    #[arg(long, value_name = "NAME", requires = "agent")]
    pub agent_name: Option<String>,
    /// This migration's policy in KubeVirt's MigrationPolicy names, as
    /// JSON: '{"completionTimeoutPerGiB":800,"progressTimeout":150,
    /// "allowAutoConverge":true,"allowPostCopy":false,"priority":1}'
    /// (docs/fleet.md).
    #[arg(long, value_name = "JSON", requires = "agent", value_parser = parse_policy)]
    pub migration_policy: Option<tern_fleet::MigrationPolicy>,
    /// Longest wait in the agent's queue for a slot, in seconds; then
    /// nothing is started.
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 3600,
        requires = "agent"
    )]
    pub agent_queue_timeout: u64,
}

fn parse_policy(text: &str) -> Result<tern_fleet::MigrationPolicy, String> {
    serde_json::from_str(text).map_err(|error| format!("not a migration policy: {error}"))
}
