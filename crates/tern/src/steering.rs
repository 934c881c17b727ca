//! The options that let a script steer and watch a command from outside
//! (`--control-socket`, `--metrics-listen`), shared by `tern migrate`,
//! `tern receive` and `tern vm migrate|receive`.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;

use clap::Args;

use crate::control_socket::{ControlSocket, Resume, Target};
use crate::metrics::MetricsEndpoint;

#[derive(Debug, Args, Default)]
pub struct SteeringArgs {
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
}

/// The control socket and metrics endpoint a command runs, if asked for.
pub struct Steering {
    socket: Option<ControlSocket>,
    metrics: Option<MetricsEndpoint>,
}

impl Steering {
    /// Starts what `args` asks for; nothing is steered until
    /// [`Steering::steer`].
    pub fn start(args: &SteeringArgs) -> anyhow::Result<Self> {
        let socket = args
            .control_socket
            .as_deref()
            .map(ControlSocket::start)
            .transpose()?;
        let metrics = args
            .metrics_listen
            .as_deref()
            .map(MetricsEndpoint::start)
            .transpose()?;
        Ok(Self { socket, metrics })
    }

    /// Steers and reports on `target` from now on.
    pub fn steer(&self, target: &Target) {
        if let Some(socket) = &self.socket {
            socket.set_target(target.clone());
        }
        if let Some(metrics) = &self.metrics {
            metrics.set_target(target.clone());
        }
    }

    /// Lets `cont` on the control socket run `resume`.
    pub fn offer_resume(&self, resume: Resume) {
        if let Some(socket) = &self.socket {
            socket.offer_resume(resume);
        }
    }
}

/// Waits for `cont` on the control socket to resume a guest handed over
/// paused, at most `timeout`; then resumes it anyway, so that it is never
/// left paused.
pub fn hand_over_paused<G: tern_engine::GuestControl>(
    guest: &mut G,
    steering: &Steering,
    handle: &tern_engine::ReceiveHandle,
    timeout: Duration,
) -> anyhow::Result<()> {
    let (asked, requests) = std::sync::mpsc::channel::<std::sync::mpsc::Sender<String>>();
    steering.offer_resume(Box::new(move || {
        let (answer, answered) = std::sync::mpsc::channel();
        asked
            .send(answer)
            .map_err(|_| anyhow::anyhow!("the hand-over is over"))?;
        match answered.recv_timeout(Duration::from_secs(10)) {
            Ok(error) if error.is_empty() => Ok(()),
            Ok(error) => Err(anyhow::anyhow!(error)),
            Err(_) => Err(anyhow::anyhow!("no answer from the receiving command")),
        }
    }));
    tracing::info!("the guest is paused here; waiting for cont on the control socket");
    let answer = match requests.recv_timeout(timeout) {
        Ok(answer) => Some(answer),
        Err(_) => {
            tracing::warn!(
                "no cont within {} s: resuming the guest so that it is not left paused",
                timeout.as_secs()
            );
            None
        }
    };
    let resumed = guest.resume();
    if let Some(answer) = answer {
        let _ = answer.send(match &resumed {
            Ok(()) => String::new(),
            Err(error) => error.to_string(),
        });
    } else if resumed.is_ok() {
        handle.note_resumed();
    }
    resumed.context("cannot resume the handed-over guest")
}
