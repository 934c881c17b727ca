//! `tern agent --metrics-listen ADDR`: every migration on the host and the
//! agent's own figures in the Prometheus text format (`GET /metrics`),
//! named after KubeVirt's metrics where it has them (docs/fleet.md).

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use anyhow::Context;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tern_fleet::protocol::{FleetState, FleetView, MigrationView};
use tern_fleet::{Agent, Division};

type Labels = Vec<(String, String)>;
type GaugeFamily = Family<Labels, Gauge<f64, AtomicU64>>;

/// A running metrics endpoint; stops when dropped.
pub(crate) struct AgentMetrics {
    server: Arc<tiny_http::Server>,
}

impl AgentMetrics {
    /// Serves `GET /metrics` on `address` from a thread of its own.
    /// It holds the agent weakly: the agent's socket goes when the agent
    /// is dropped, whatever a scrape is doing.
    pub(crate) fn start(address: &str, agent: std::sync::Weak<Agent>) -> anyhow::Result<Self> {
        let server = Arc::new(
            tiny_http::Server::http(address)
                .map_err(|error| anyhow::anyhow!("{error}"))
                .with_context(|| format!("--metrics-listen {address}"))?,
        );
        let serving = server.clone();
        std::thread::Builder::new()
            .name("tern-agent-metrics".into())
            .spawn(move || {
                for request in serving.incoming_requests() {
                    let response = match (request.method(), request.url()) {
                        (tiny_http::Method::Get, "/metrics" | "/") => {
                            let text = agent
                                .upgrade()
                                .map_or_else(|| "# EOF\n".into(), |agent| render(&agent.view()));
                            let mut response = tiny_http::Response::from_string(text);
                            if let Ok(header) = tiny_http::Header::from_bytes(
                                "Content-Type",
                                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                            ) {
                                response.add_header(header);
                            }
                            response
                        }
                        _ => tiny_http::Response::from_string("only GET /metrics\n")
                            .with_status_code(404),
                    };
                    let _ = request.respond(response);
                }
            })
            .context("cannot start the metrics thread")?;
        Ok(Self { server })
    }
}

impl Drop for AgentMetrics {
    fn drop(&mut self) {
        self.server.unblock();
    }
}

fn family(registry: &mut Registry, name: &str, help: &str) -> GaugeFamily {
    let family = GaugeFamily::default();
    registry.register(name, help, family.clone());
    family
}

/// The exposition for one listing.
pub(crate) fn render(view: &FleetView) -> String {
    let mut registry = Registry::default();
    fleet_gauges(&mut registry, view);
    migration_gauges(&mut registry, &view.migrations);
    let mut text = String::new();
    if encode(&mut text, &registry).is_err() {
        return "# EOF\n".into();
    }
    text
}

fn fleet_gauges(registry: &mut Registry, view: &FleetView) {
    let pending = family(
        registry,
        "tern_fleet_migrations_in_pending_phase",
        "Migrations queued for a slot (kubevirt_vmi_migrations_in_pending_phase).",
    );
    let running = family(
        registry,
        "tern_fleet_migrations_in_running_phase",
        "Migrations holding a slot (kubevirt_vmi_migrations_in_running_phase).",
    );
    let slots = family(
        registry,
        "tern_fleet_slots",
        "Slots (parallelOutboundMigrationsPerNode for outbound).",
    );
    for (direction, count) in [
        ("outbound", view.outbound_slots),
        ("inbound", view.inbound_slots),
    ] {
        let labels = vec![("direction".to_string(), direction.to_string())];
        let of = |state: fn(FleetState) -> bool| {
            view.migrations
                .iter()
                .filter(|member| member.direction.as_str() == direction && state(member.state))
                .count() as f64
        };
        pending
            .get_or_create(&labels)
            .set(of(|state| state == FleetState::Queued));
        running
            .get_or_create(&labels)
            .set(of(|state| state != FleetState::Queued));
        slots.get_or_create(&labels).set(f64::from(count));
    }
    let plain = |registry: &mut Registry, name: &str, help: &str, value: f64| {
        family(registry, name, help)
            .get_or_create(&Vec::new())
            .set(value);
    };
    plain(
        registry,
        "tern_fleet_bandwidth_budget_bytes",
        "The host's bandwidth budget, bytes per second (0: none).",
        view.bandwidth as f64,
    );
    plain(
        registry,
        "tern_fleet_bandwidth_shared_bytes",
        "The shares in force added up, bytes per second.",
        view.migrations
            .iter()
            .map(|member| member.share as f64)
            .sum(),
    );
    plain(
        registry,
        "tern_fleet_division_equal",
        "1 when the budget is divided in equal shares, 0 for converge-first.",
        f64::from(u8::from(view.division == Division::Equal)),
    );
    plain(
        registry,
        "tern_fleet_migrations_succeeded",
        "Migrations completed since the agent started (kubevirt_vmi_migration_succeeded, summed).",
        view.counters.succeeded as f64,
    );
    plain(
        registry,
        "tern_fleet_migrations_failed",
        "Migrations failed, cancelled or vanished since the agent started (kubevirt_vmi_migration_failed, summed).",
        view.counters.failed as f64,
    );
}

fn migration_gauges(registry: &mut Registry, migrations: &[MigrationView]) {
    type Value = fn(&MigrationView) -> Option<f64>;
    let gauges: [(&str, &str, Value); 8] = [
        (
            "tern_migration_data_processed_bytes",
            "Bytes moved so far (kubevirt_vmi_migration_data_processed_bytes).",
            |member| Some(member.progress.transferred as f64),
        ),
        (
            "tern_migration_data_remaining_bytes",
            "Dirty bytes still to send (kubevirt_vmi_migration_data_remaining_bytes).",
            |member| Some(member.progress.remaining as f64),
        ),
        (
            "tern_migration_data_total_bytes",
            "Guest memory (kubevirt_vmi_migration_data_total_bytes).",
            |member| Some(member.progress.total as f64),
        ),
        (
            "tern_migration_dirty_memory_rate_bytes",
            "Bytes per second the guest dirties (kubevirt_vmi_migration_dirty_memory_rate_bytes).",
            |member| Some(member.progress.dirty_rate as f64),
        ),
        (
            "tern_migration_memory_transfer_rate_bytes",
            "Bytes per second moving now (kubevirt_vmi_migration_memory_transfer_rate_bytes).",
            |member| Some(member.progress.transfer_rate as f64),
        ),
        (
            "tern_fleet_share_bytes",
            "The migration's share of the budget, bytes per second (0: uncapped).",
            |member| Some(member.share as f64),
        ),
        (
            "tern_fleet_queue_position",
            "Place in the queue for a slot, 1 first (absent when running).",
            |member| member.position.map(f64::from),
        ),
        (
            "tern_fleet_measured_rate_bytes",
            "Bytes per second the agent saw the member's process write.",
            |member| member.measured_rate.map(|rate| rate as f64),
        ),
    ];
    for (name, help, value) in gauges {
        let family = family(registry, name, help);
        for member in migrations {
            if let Some(value) = value(member) {
                family.get_or_create(&labels(member)).set(value);
            }
        }
    }
}

fn labels(member: &MigrationView) -> Labels {
    vec![
        ("migration".into(), member.migration.clone()),
        ("name".into(), member.name.clone()),
        ("direction".into(), member.direction.as_str().into()),
        (
            "state".into(),
            match member.state {
                FleetState::Queued => "queued",
                FleetState::Running => "running",
                FleetState::Held => "held",
            }
            .into(),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use tern_fleet::protocol::{Direction, FleetCounters, FleetState, MigrationView, Progress};
    use tern_fleet::{Division, FleetView, MigrationPolicy};

    #[test]
    fn every_migration_is_labelled_and_the_phases_counted() {
        let member = |id: &str, state, position| MigrationView {
            migration: id.into(),
            name: format!("vm-{id}"),
            direction: Direction::Outbound,
            pid: 1,
            state,
            position,
            share: 5,
            policy: MigrationPolicy::default(),
            progress: Progress {
                transferred: 77,
                ..Progress::default()
            },
            measured_rate: None,
            progress_verified: true,
            queued_seconds: 0.0,
            running_seconds: 0.0,
            last_action: None,
        };
        let view = FleetView {
            version: 1,
            bandwidth: 100,
            outbound_slots: 1,
            inbound_slots: 2,
            division: Division::ConvergeFirst,
            migrations: vec![
                member("m1", FleetState::Running, None),
                member("m2", FleetState::Queued, Some(1)),
            ],
            counters: FleetCounters::default(),
        };
        let text = super::render(&view);
        assert!(
            text.contains(r#"tern_fleet_migrations_in_pending_phase{direction="outbound"} 1"#),
            "{text}"
        );
        assert!(
            text.contains(r#"tern_fleet_migrations_in_running_phase{direction="outbound"} 1"#),
            "{text}"
        );
        assert!(text.contains(
            r#"tern_migration_data_processed_bytes{migration="m2",name="vm-m2",direction="outbound",state="queued"} 77"#
        ), "{text}");
        assert!(
            text.contains(r#"tern_fleet_queue_position{migration="m2""#),
            "{text}"
        );
        assert!(
            !text.contains(r#"tern_fleet_queue_position{migration="m1""#),
            "{text}"
        );
    }
}
