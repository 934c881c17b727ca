//! `tern agent`'s syntax.

use std::path::PathBuf;

use clap::{Args, ValueEnum};
use tern_fleet::Division;

use crate::units::parse_rate;

#[derive(Debug, Args)]
pub(crate) struct AgentArgs {
    /// The agent's Unix socket (created mode 0600; other users refused).
    #[arg(long, value_name = "PATH")]
    pub socket: PathBuf,
    /// The host's bandwidth budget shared by outbound migrations (e.g.
    /// 1Gbit, 100MiB); none by default (each migration keeps its own cap).
    #[arg(long, value_parser = parse_rate)]
    pub bandwidth: Option<u64>,
    /// Migrations leaving at once (KubeVirt's
    /// parallelOutboundMigrationsPerNode, Nova's
    /// max_concurrent_live_migrations).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    pub outbound_slots: u32,
    /// Migrations arriving at once.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    pub inbound_slots: u32,
    /// How the budget is divided (docs/fleet.md, "The division").
    #[arg(long, value_enum, default_value_t = DivisionArg::ConvergeFirst)]
    pub division: DivisionArg,
    /// Serve every migration's figures and the agent's own in the
    /// Prometheus text format on HOST:PORT (`GET /metrics`).
    #[arg(long, value_name = "HOST:PORT")]
    pub metrics_listen: Option<String>,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum DivisionArg {
    /// Floors against each dirty rate, the rest to the migration that
    /// finishes soonest for what its delay costs.
    ConvergeFirst,
    /// Equal shares.
    Equal,
}

impl From<DivisionArg> for Division {
    fn from(division: DivisionArg) -> Self {
        match division {
            DivisionArg::ConvergeFirst => Division::ConvergeFirst,
            DivisionArg::Equal => Division::Equal,
        }
    }
}
