//! CPU seconds per GiB over loopback TCP: plain `sendmsg` against
//! `MSG_ZEROCOPY` and io_uring `SENDMSG_ZC`. Usage: `zerocopy_cpu [GiB] [window MiB] [rounds]`.
//!
//! Loopback always copies (every completion is flagged
//! `SO_EE_CODE_ZEROCOPY_COPIED`), so this measures the cost of the
//! zero-copy bookkeeping; the gain needs a real NIC.

use tern_engine::zerocopy::{SendMode, measure_cpu_per_gib};

fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let mut args = std::env::args().skip(1);
    let gib: f64 = args.next().map_or(Ok(1.0), |a| a.parse())?;
    let window_mib: usize = args.next().map_or(Ok(4), |a| a.parse())?;
    let rounds: usize = args.next().map_or(Ok(3), |a| a.parse())?;
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "float-to-integer `as` saturates: a negative or huge argument clamps"
    )]
    let bytes = (gib * f64::from(1u32 << 30)) as u64;
    let modes = [
        SendMode::Plain,
        SendMode::ZeroCopy {
            window_bytes: window_mib << 20,
        },
        SendMode::UringZeroCopy {
            window_bytes: window_mib << 20,
        },
    ];
    for round in 0..rounds {
        for mode in modes {
            let m = measure_cpu_per_gib(bytes, mode)?;
            println!(
                "round {round} {:<40} sender {:.3} CPU-s/GiB, process {:.3} CPU-s/GiB, {:.2} GiB/s wall",
                format!("{mode:?}"),
                m.sender_cpu_per_gib(),
                m.process_cpu_per_gib(),
                m.bytes as f64 / f64::from(1u32 << 30) / m.wall_seconds,
            );
            if let Some(stats) = m.stats {
                println!("        {stats:?}");
            }
        }
    }
    Ok(())
}
