//! `tern vm receive`: `tern receive`'s implementation with a KVM guest,
//! checked and let run on here.

use std::process::ExitCode;
use std::time::Duration;

use serde::Serialize;
use tern_engine::{GuestError, ReceiveHandle, Received};
use tern_vmm::KvmGuest;
use tern_wire::SessionSetup;

use super::guest::{
    DestinationProof, prepare_destination, prepare_handover_destination, prove_on_destination,
};
use crate::args::vm::ReceiveArgs;
use crate::command::receive::{Adopt, Arrival, Serving, serve};
use crate::report::print_json;
use crate::units::human_bytes;

/// `tern vm receive`.
pub(super) fn run(args: &ReceiveArgs) -> anyhow::Result<ExitCode> {
    let serving = Serving {
        listen: &args.listen,
        json: args.json,
        save_vmm_config: None,
    };
    serve(&serving, &KvmArrival { args })
}

/// `tern vm receive --json`'s document: the destination's report and what
/// the guest did on here.
#[derive(Serialize)]
#[serde(rename_all = "kebab-case")]
struct ReceiveJson<'a> {
    #[serde(flatten)]
    report: tern_engine::ReceiveReport,
    #[serde(flatten)]
    proof: &'a DestinationProof,
}

/// A KVM guest, received into a VM built before the source connects, then
/// checked (its working set consistent, its pass counter advancing).
struct KvmArrival<'a> {
    args: &'a ReceiveArgs,
}

impl Arrival for KvmArrival<'_> {
    type Guest = KvmGuest;

    fn prepare(
        &self,
    ) -> anyhow::Result<impl FnOnce(&SessionSetup) -> Result<KvmGuest, GuestError>> {
        prepare_destination()
    }

    fn prepare_handover(&self) -> anyhow::Result<impl Adopt<KvmGuest>> {
        prepare_handover_destination()
    }

    fn report(
        &self,
        received: Received<KvmGuest>,
        handle: &ReceiveHandle,
        _vmm_config: &[u8],
    ) -> anyhow::Result<ExitCode> {
        let Received {
            mut guest,
            stats,
            security,
            ..
        } = received;
        let proof = prove_on_destination(&mut guest, Duration::from_millis(self.args.run_after))?;
        let report = handle.query();
        if self.args.json {
            print_json(&ReceiveJson {
                report,
                proof: &proof,
            })?;
        } else {
            if self.args.listen.local {
                println!(
                    "received {} by hand-over, no page copied",
                    human_bytes(report.memory)
                );
            } else {
                println!(
                    "received {} ({} pages with data, {} zero)",
                    human_bytes(report.memory),
                    stats.normal_pages,
                    stats.zero_pages
                );
            }
            println!(
                "{:>26}  {}",
                "security",
                crate::report::security_line(&security)
            );
            for (name, value) in proof.rows() {
                println!("{name:>26}  {value}");
            }
        }
        Ok(if proof.passed() {
            ExitCode::SUCCESS
        } else {
            ExitCode::from(1)
        })
    }
}
