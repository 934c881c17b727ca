//! `tern receive`, and the one implementation of receiving that `tern vm
//! receive` shares: serving migrations on a listener, steering each, the
//! paused hand-over, the report of a failed one. What differs between a
//! synthetic guest and a KVM guest is an [`Arrival`].

use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use serde::Serialize;
use tern_engine::{
    Destination, DestinationGuest, GuestControl, GuestError, HandedFile, Listener, MigrationError,
    ReceiveHandle, Received,
};
use tern_synthetic::SyntheticGuest;
use tern_wire::SessionSetup;

use crate::args::{ListenArgs, ReceiveArgs};
use crate::control_socket::Target;
use crate::report::{Progress, print_json, security_line};
use crate::session::{self, Incomplete};
use crate::steering::Steering;

/// What `tern receive` and `tern vm receive` differ in: the guest built for
/// the layout the source announces, and what is checked and reported once
/// it runs here.
pub(crate) trait Arrival {
    /// The guest received.
    type Guest: DestinationGuest + GuestControl;

    /// Prepares, before the source connects (a VM can take long to create),
    /// the step that builds the guest for the layout the source announces.
    fn prepare(
        &self,
    ) -> anyhow::Result<impl FnOnce(&SessionSetup) -> Result<Self::Guest, GuestError>>;

    /// With `--local`: prepares the step that builds the guest around the
    /// memory a source on this host hands over, one checked file per
    /// region, instead of receiving a copy.
    fn prepare_handover(&self) -> anyhow::Result<impl Adopt<Self::Guest>>;

    /// Checks the received guest, which runs here now, and prints the
    /// report; `handle` queries the destination's report, `vmm_config` is
    /// what the source sent as the VMM's configuration. Returns the exit
    /// status.
    fn report(
        &self,
        received: Received<Self::Guest>,
        handle: &ReceiveHandle,
        vmm_config: &[u8],
    ) -> anyhow::Result<ExitCode>;
}

/// Builds a guest around the memory a source on this host handed over: the
/// session setup and one checked file per region.
pub(crate) trait Adopt<G>:
    FnOnce(&SessionSetup, Vec<HandedFile>) -> Result<G, GuestError>
{
}

impl<G, F> Adopt<G> for F where F: FnOnce(&SessionSetup, Vec<HandedFile>) -> Result<G, GuestError> {}

/// The options every receiving command has.
pub(crate) struct Serving<'a> {
    /// Where and how to wait.
    pub listen: &'a ListenArgs,
    /// `--json`: one document instead of the summary.
    pub json: bool,
    /// `--save-vmm-config`: where to write the VMM configuration received.
    pub save_vmm_config: Option<&'a Path>,
}

/// `tern receive`.
pub(crate) fn run(args: &ReceiveArgs) -> anyhow::Result<ExitCode> {
    let serving = Serving {
        listen: &args.listen,
        json: args.json,
        save_vmm_config: args.save_vmm_config.as_deref(),
    };
    serve(&serving, &SyntheticArrival { args })
}

/// Serves incoming migrations (one, or with `--keep-listening` one after
/// another), each steered and joined to the agent as the options say.
pub(crate) fn serve(serving: &Serving<'_>, arrival: &impl Arrival) -> anyhow::Result<ExitCode> {
    let steering = Steering::start(&serving.listen.steering)?;
    session::serve_sessions(serving.listen, |destination, listener| {
        steering.steer(&Target::Destination(destination.handle()));
        steering.join_agent(
            &Target::Destination(destination.handle()),
            &destination.cancel_token(),
        )?;
        receive_one(serving, arrival, destination, listener, &steering)
    })
}

/// `tern receive --json`'s document: the destination's report and whether
/// the resumed guest went on writing memory.
#[derive(Serialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub(crate) struct ReceiveJson {
    #[serde(flatten)]
    report: tern_engine::ReceiveReport,
    /// Whether the guest, resumed here, went on writing memory.
    #[serde(skip_serializing_if = "Option::is_none")]
    resumed_guest_dirtying: Option<bool>,
    /// Bytes of the VMM configuration the source sent, when it sent one.
    #[serde(skip_serializing_if = "Option::is_none")]
    vmm_config_bytes: Option<u64>,
}

fn receive_one<A: Arrival>(
    serving: &Serving<'_>,
    arrival: &A,
    destination: &Destination,
    listener: &Listener,
    steering: &Steering,
) -> anyhow::Result<ExitCode> {
    let mut vmm_config = Vec::new();
    let received = receive_guest(
        serving.listen.local,
        arrival,
        destination,
        listener,
        &mut vmm_config,
    )?;
    if let Some(path) = serving.save_vmm_config
        && received.is_ok()
    {
        std::fs::write(path, &vmm_config)
            .with_context(|| format!("--save-vmm-config {}", path.display()))?;
    }
    let mut received = match received {
        Ok(received) => received,
        Err(error) => {
            if serving.json {
                print_json(&ReceiveJson {
                    report: destination.handle().query(),
                    resumed_guest_dirtying: None,
                    vmm_config_bytes: None,
                })?;
            }
            return Err(Incomplete::error(
                error,
                "the incoming migration did not complete",
            ));
        }
    };
    if !received.resumed {
        crate::steering::hand_over_paused(
            &mut received.guest,
            steering,
            &destination.handle(),
            Duration::from_secs(serving.listen.paused_timeout),
        )?;
    }
    arrival.report(received, &destination.handle(), &vmm_config)
}

/// Receives the guest: a copy, or with `--local` the source's memory by
/// hand-over, mapped from the files it passed. `vmm_config` gets the
/// configuration the source sent. The outer error is the arrival's own
/// preparation failing; the inner one the migration's.
fn receive_guest<A: Arrival>(
    local: bool,
    arrival: &A,
    destination: &Destination,
    listener: &Listener,
    vmm_config: &mut Vec<u8>,
) -> anyhow::Result<Result<Received<A::Guest>, MigrationError>> {
    let received = if local {
        let adopt = arrival.prepare_handover()?;
        let progress = Progress::receiving(destination.stats());
        let received = destination.receive_handover(listener, |setup, config, files| {
            *vmm_config = config.to_vec();
            adopt(setup, files)
        });
        progress.finish();
        received
    } else {
        let make_guest = arrival.prepare()?;
        let progress = Progress::receiving(destination.stats());
        let received = destination.receive_with_vmm_config(listener, |setup, config| {
            *vmm_config = config.to_vec();
            make_guest(setup)
        });
        progress.finish();
        received
    };
    Ok(received)
}

/// `tern receive`'s guest: a synthetic guest, shown to go on dirtying
/// memory here.
struct SyntheticArrival<'a> {
    args: &'a ReceiveArgs,
}

impl Arrival for SyntheticArrival<'_> {
    type Guest = SyntheticGuest;

    fn prepare(
        &self,
    ) -> anyhow::Result<impl FnOnce(&SessionSetup) -> Result<SyntheticGuest, GuestError>> {
        Ok(session::destination_guest)
    }

    fn prepare_handover(&self) -> anyhow::Result<impl Adopt<SyntheticGuest>> {
        Ok(|_: &SessionSetup, files: Vec<HandedFile>| {
            SyntheticGuest::from_handed_files(files).map_err(|error| {
                GuestError::with_source("cannot map the handed-over memory", error)
            })
        })
    }

    fn report(
        &self,
        received: Received<SyntheticGuest>,
        handle: &ReceiveHandle,
        vmm_config: &[u8],
    ) -> anyhow::Result<ExitCode> {
        let running = session::guest_keeps_running(
            &received.guest,
            Duration::from_millis(self.args.run_after),
        );
        let report = handle.query();
        if self.args.json {
            print_json(&ReceiveJson {
                report,
                resumed_guest_dirtying: Some(running),
                vmm_config_bytes: (!vmm_config.is_empty()).then_some(vmm_config.len() as u64),
            })?;
        } else {
            let how = if self.args.listen.local {
                "by hand-over, no page copied".to_string()
            } else {
                format!(
                    "in {} pages with data and {} zero pages",
                    received.stats.normal_pages, received.stats.zero_pages
                )
            };
            println!(
                "received {} {how}; digest {}; guest resumed{}",
                crate::units::human_bytes(report.memory),
                if report.digest_verified {
                    "verified"
                } else {
                    "not checked (--verify none)"
                },
                if running { " and dirtying memory" } else { "" }
            );
            println!("channels: {}", security_line(&received.security));
        }
        Ok(ExitCode::SUCCESS)
    }
}
