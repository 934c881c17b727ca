//! The options that let a script steer and watch a command from outside
//! (`--control-socket`, `--metrics-listen`), shared by `tern migrate`,
//! `tern receive` and `tern vm migrate|receive`.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;

use crate::args::steering::SteeringArgs;
use crate::control_socket::{ControlSocket, Resume, Target};
use crate::metrics::MetricsEndpoint;

/// The control socket, metrics endpoint and agent membership a command
/// runs, if asked for.
pub(crate) struct Steering {
    socket: Option<ControlSocket>,
    metrics: Option<MetricsEndpoint>,
    agent: Option<AgentOptions>,
    membership: std::sync::Mutex<Option<tern_fleet::Membership>>,
}

/// How to join the agent.
struct AgentOptions {
    path: PathBuf,
    options: tern_fleet::JoinOptions,
}

impl Steering {
    /// Starts what `args` asks for; nothing is steered until
    /// [`Steering::steer`].
    pub(crate) fn start(args: &SteeringArgs) -> anyhow::Result<Self> {
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
        let agent = args.agent.clone().map(|path| {
            let name = args
                .agent_name
                .clone()
                .unwrap_or_else(|| format!("tern-{}", std::process::id()));
            let mut options = tern_fleet::JoinOptions::new(name);
            options.policy = args.migration_policy.clone().unwrap_or_default();
            options.queue_timeout = Duration::from_secs(args.agent_queue_timeout);
            AgentOptions { path, options }
        });
        Ok(Self {
            socket,
            metrics,
            agent,
            membership: std::sync::Mutex::new(None),
        })
    }

    /// Steers and reports on `target` from now on.
    pub(crate) fn steer(&self, target: &Target) {
        if let Some(socket) = &self.socket {
            socket.set_target(target.clone());
        }
        if let Some(metrics) = &self.metrics {
            metrics.set_target(target.clone());
        }
    }

    /// With `--agent`: joins the agent with `target` (leaving it with the
    /// one before, for `--keep-listening`) and waits for a slot, or until
    /// `cancel` is cancelled (a signal).
    pub(crate) fn join_agent(
        &self,
        target: &Target,
        cancel: &tern_engine::CancelToken,
    ) -> anyhow::Result<()> {
        let Some(agent) = &self.agent else {
            return Ok(());
        };
        let mut membership = self.membership.lock().unwrap_or_else(|e| e.into_inner());
        membership.take();
        let steered = match target {
            Target::Source(handle) => tern_fleet::Steered::Source(handle.clone()),
            Target::Destination(handle) => tern_fleet::Steered::Destination(handle.clone()),
        };
        let mut options = agent.options.clone();
        options.cancel = Some(cancel.clone());
        let joined = tern_fleet::join(&agent.path, steered, options)
            .with_context(|| format!("--agent {}", agent.path.display()))?;
        *membership = Some(joined);
        Ok(())
    }

    /// Lets `cont` on the control socket run `resume`.
    pub(crate) fn offer_resume(&self, resume: Resume) {
        if let Some(socket) = &self.socket {
            socket.offer_resume(resume);
        }
    }
}

/// Waits for `cont` on the control socket to resume a guest handed over
/// paused, at most `timeout`; then resumes it anyway, so that it is never
/// left paused.
pub(crate) fn hand_over_paused<G: tern_engine::GuestControl>(
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
        let event = handle.note_resumed();
        if let Some(socket) = &steering.socket {
            socket.forward(&event);
        }
    }
    resumed.context("cannot resume the handed-over guest")
}
