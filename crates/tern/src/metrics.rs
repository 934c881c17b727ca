//! `--metrics-listen ADDR`: the migration's figures in the Prometheus text
//! format over HTTP (`GET /metrics`), one `tern_migration_*` metric for each
//! of KubeVirt's `kubevirt_vmi_migration_*` ones (docs/control.md).

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Context;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tern_engine::{MigrationStatus, PAGE_SIZE};

use crate::control_socket::Target;

/// A running metrics endpoint; stops when dropped.
pub(crate) struct MetricsEndpoint {
    server: Arc<tiny_http::Server>,
    shared: Arc<Mutex<Watched>>,
}

/// What the endpoint reports on, and when it started watching it.
#[derive(Default)]
struct Watched {
    target: Option<Target>,
    started: f64,
    /// When a scrape first found the migration ended.
    ended: Option<f64>,
}

fn lock(watched: &Mutex<Watched>) -> MutexGuard<'_, Watched> {
    watched.lock().unwrap_or_else(|e| e.into_inner())
}

impl MetricsEndpoint {
    /// Serves `GET /metrics` on `address` (HOST:PORT) from a thread of its
    /// own.
    pub(crate) fn start(address: &str) -> anyhow::Result<Self> {
        let server = Arc::new(
            tiny_http::Server::http(address)
                .map_err(|error| anyhow::anyhow!("{error}"))
                .with_context(|| format!("--metrics-listen {address}"))?,
        );
        let shared = Arc::new(Mutex::new(Watched::default()));
        let serving = (server.clone(), shared.clone());
        std::thread::Builder::new()
            .name("tern-metrics".into())
            .spawn(move || serve(&serving.0, &serving.1))
            .context("cannot start the metrics thread")?;
        Ok(Self { server, shared })
    }

    /// Reports on `target` from now on.
    pub(crate) fn set_target(&self, target: Target) {
        let mut watched = lock(&self.shared);
        watched.target = Some(target);
        watched.started = unix_seconds();
        watched.ended = None;
    }
}

impl Drop for MetricsEndpoint {
    fn drop(&mut self) {
        self.server.unblock();
    }
}

fn unix_seconds() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

fn serve(server: &tiny_http::Server, shared: &Mutex<Watched>) {
    for request in server.incoming_requests() {
        let response = match (request.method(), request.url()) {
            (tiny_http::Method::Get, "/metrics" | "/") => {
                let text = render(&mut lock(shared));
                let content_type = tiny_http::Header::from_bytes(
                    "Content-Type",
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                );
                let mut response = tiny_http::Response::from_string(text);
                if let Ok(header) = content_type {
                    response.add_header(header);
                }
                response
            }
            _ => tiny_http::Response::from_string("only GET /metrics\n").with_status_code(404),
        };
        let _ = request.respond(response);
    }
}

/// One scrape's figures, as KubeVirt's migration metrics define them.
#[derive(Debug, PartialEq)]
pub(crate) struct Figures {
    /// Bytes moved so far.
    pub processed: u64,
    /// Bytes still to move, when known.
    pub remaining: Option<u64>,
    /// Guest memory size.
    pub total: u64,
    /// Bytes per second the guest dirties (the source only).
    pub dirty_rate: Option<u64>,
    /// Bytes per second moving now (the source only).
    pub transfer_rate: Option<u64>,
    /// Milliseconds since the start.
    pub elapsed_ms: u64,
    /// The status.
    pub status: MigrationStatus,
}

impl Figures {
    fn of(target: &Target) -> Self {
        match target {
            Target::Source(handle) => {
                let report = handle.query();
                Self {
                    processed: report.ram.transferred,
                    remaining: Some(report.ram.remaining),
                    total: report.ram.total,
                    dirty_rate: Some(report.ram.dirty_pages_rate * PAGE_SIZE as u64),
                    transfer_rate: Some(report.ram.transfer_rate),
                    elapsed_ms: report.total_time,
                    status: report.status,
                }
            }
            Target::Destination(handle) => {
                let report = handle.query();
                Self {
                    processed: report.stats.received,
                    remaining: None,
                    total: report.memory,
                    dirty_rate: None,
                    transfer_rate: None,
                    elapsed_ms: 0,
                    status: report.status,
                }
            }
        }
    }
}

fn render(watched: &mut Watched) -> String {
    let Some(target) = &watched.target else {
        return "# EOF\n".into();
    };
    let side = match target {
        Target::Source(_) => "source",
        Target::Destination(_) => "destination",
    };
    let figures = Figures::of(target);
    if figures.status.is_final() && watched.ended.is_none() {
        watched.ended = Some(if figures.elapsed_ms > 0 {
            watched.started + figures.elapsed_ms as f64 / 1000.0
        } else {
            unix_seconds()
        });
    }
    let mut registry = Registry::with_prefix_and_labels(
        "tern_migration",
        [("side".into(), side.into())].into_iter(),
    );
    for (name, help, value) in samples(&figures, watched) {
        if let Some(value) = value {
            let metric = Gauge::<f64, AtomicU64>::default();
            metric.set(value);
            registry.register(name, help, metric);
        }
    }
    let mut text = String::new();
    if encode(&mut text, &registry).is_err() {
        return "# EOF\n".into();
    }
    text
}

/// Each metric: its name after the `tern_migration_` prefix, its help
/// (naming KubeVirt's metric it maps onto), and its value when known.
fn samples(figures: &Figures, watched: &Watched) -> [(&'static str, &'static str, Option<f64>); 9] {
    let ended = figures.status.is_final();
    let known = |value: Option<u64>| value.map(|value| value as f64);
    [
        (
            "data_processed_bytes",
            "Bytes of guest data moved so far (kubevirt_vmi_migration_data_processed_bytes).",
            known(Some(figures.processed)),
        ),
        (
            "data_remaining_bytes",
            "Dirty guest bytes still to move (kubevirt_vmi_migration_data_remaining_bytes).",
            known(figures.remaining),
        ),
        (
            "data_total_bytes",
            "Guest memory to move (kubevirt_vmi_migration_data_total_bytes).",
            known(Some(figures.total)),
        ),
        (
            "dirty_memory_rate_bytes",
            "Bytes per second the guest dirties (kubevirt_vmi_migration_dirty_memory_rate_bytes).",
            known(figures.dirty_rate),
        ),
        (
            "memory_transfer_rate_bytes",
            "Bytes per second moving now (kubevirt_vmi_migration_memory_transfer_rate_bytes).",
            known(figures.transfer_rate),
        ),
        (
            "start_time_seconds",
            "When the migration started, Unix time (kubevirt_vmi_migration_start_time_seconds).",
            Some(watched.started),
        ),
        (
            "end_time_seconds",
            "When the migration ended, Unix time (kubevirt_vmi_migration_end_time_seconds).",
            watched.ended,
        ),
        (
            "succeeded",
            "1 once the migration completed (kubevirt_vmi_migration_succeeded).",
            Some(f64::from(u8::from(
                figures.status == MigrationStatus::Completed,
            ))),
        ),
        (
            "failed",
            "1 once the migration failed or was cancelled (kubevirt_vmi_migration_failed).",
            Some(f64::from(u8::from(
                ended && figures.status != MigrationStatus::Completed,
            ))),
        ),
    ]
}
