//! Measures the sending thread's CPU time per GiB with each sender.

use std::time::{Duration, Instant};

use super::msg::ZeroCopySender;
use super::uring::UringZeroCopySender;
use super::{KERNEL_PAGE, ZeroCopyStats, ZeroCopyTransport};
use crate::error::ChannelError;
use crate::transport::{Address, Channel, Listener, Segment};

/// How [`measure_cpu_per_gib`] sends page payloads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SendMode {
    /// `sendmsg` copying from the buffer (what the pipeline does today).
    Plain,
    /// [`ZeroCopySender`] with the given window.
    ZeroCopy {
        /// In-flight window in bytes.
        window_bytes: usize,
    },
    /// [`UringZeroCopySender`](UringZeroCopySender)
    /// (io_uring `SENDMSG_ZC`) with the given window.
    UringZeroCopy {
        /// In-flight window in bytes.
        window_bytes: usize,
    },
}

/// What [`measure_cpu_per_gib`] measured.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct CpuMeasurement {
    /// How it was sent.
    pub mode: SendMode,
    /// Payload bytes sent (headers excluded).
    pub bytes: u64,
    /// CPU seconds of the sending thread. On loopback this includes the
    /// kernel's receive-side processing run in the sender's context.
    pub sender_cpu_seconds: f64,
    /// CPU seconds of the whole process (sender and reader).
    pub process_cpu_seconds: f64,
    /// Wall-clock seconds.
    pub wall_seconds: f64,
    /// Zero-copy accounting, for the zero-copy modes.
    pub stats: Option<ZeroCopyStats>,
}

impl CpuMeasurement {
    /// Sending-thread CPU seconds per GiB of payload.
    pub fn sender_cpu_per_gib(&self) -> f64 {
        self.sender_cpu_seconds / (self.bytes as f64 / f64::from(1u32 << 30))
    }

    /// Whole-process CPU seconds per GiB of payload.
    pub fn process_cpu_per_gib(&self) -> f64 {
        self.process_cpu_seconds / (self.bytes as f64 / f64::from(1u32 << 30))
    }
}

/// Sends `total_bytes` of page payload over a loopback TCP connection, in
/// batches of 64 pages with a 64-byte copied header each (like the
/// pipeline's page packets), while a reader thread drains the other end, and
/// measures CPU time. Loopback always copies, so this measures the cost of
/// the zero-copy machinery, not its gain; that needs a real NIC.
pub fn measure_cpu_per_gib(
    total_bytes: u64,
    mode: SendMode,
) -> Result<CpuMeasurement, MeasureError> {
    const PAGES_PER_BATCH: usize = 64;
    const HEADER: usize = 64;
    const BUFFER: usize = 64 << 20;
    let batch_bytes = PAGES_PER_BATCH * KERNEL_PAGE;
    let batches = total_bytes.div_ceil(batch_bytes as u64);
    let bytes = batches * batch_bytes as u64;

    let expected = batches * (batch_bytes + HEADER) as u64;
    let (mut channel, reader) = loopback_with_reader(expected)?;

    let memory: Vec<u8> = (0..BUFFER)
        .map(|i| crate::numeric::low_byte((i / KERNEL_PAGE) as u64))
        .collect();
    let header = [0x5au8; HEADER];
    // `None` sends with plain `sendmsg`.
    let mut sender: Option<Box<dyn ZeroCopyTransport>> =
        match mode {
            SendMode::Plain => None,
            SendMode::ZeroCopy { window_bytes } => Some(Box::new(ZeroCopySender::enable(
                channel.try_clone()?,
                1,
                window_bytes,
            )?)),
            SendMode::UringZeroCopy { window_bytes } => Some(Box::new(
                UringZeroCopySender::enable(channel.try_clone()?, 1, window_bytes)?,
            )),
        };
    let process_start = tern_page::cpu_time::process_cpu_ns() as f64 / 1e9;
    let thread_start = crate::stats::thread_cpu_seconds();
    let wall = Instant::now();
    for batch in 0..batches {
        let offset = (crate::numeric::saturating_usize(batch) * batch_bytes) % BUFFER;
        let page = Segment {
            // `offset + batch_bytes <= BUFFER` since BUFFER is a multiple.
            ptr: memory[offset..].as_ptr(),
            len: batch_bytes,
        };
        match &mut sender {
            None => {
                let segments = [
                    Segment {
                        ptr: header.as_ptr(),
                        len: HEADER,
                    },
                    page,
                ];
                // SAFETY: `header` and `memory` outlive the call.
                unsafe { channel.send_vectored(&segments) }?;
            }
            // SAFETY: `memory` outlives the sender, which is flushed below.
            Some(sender) => unsafe { sender.send(&header, &[page]) }?,
        }
    }
    let stats = match &mut sender {
        Some(sender) => {
            sender.flush()?;
            Some(sender.stats())
        }
        None => None,
    };
    let sender_cpu_seconds = crate::stats::thread_cpu_seconds() - thread_start;
    reader.join().map_err(|_| "reader thread panicked")??;
    let wall_seconds = wall.elapsed().as_secs_f64();
    let process_cpu_seconds = tern_page::cpu_time::process_cpu_ns() as f64 / 1e9 - process_start;
    Ok(CpuMeasurement {
        mode,
        bytes,
        sender_cpu_seconds,
        process_cpu_seconds,
        wall_seconds,
        stats,
    })
}

/// What can fail while measuring.
type MeasureError = Box<dyn std::error::Error + Send + Sync>;

/// A loopback TCP channel whose peer a thread drains of `expected` bytes.
fn loopback_with_reader(
    expected: u64,
) -> Result<(Channel, std::thread::JoinHandle<Result<(), ChannelError>>), MeasureError> {
    let listener = Listener::bind(&Address::Tcp("127.0.0.1:0".into()))?;
    let address = listener.local_address()?;
    let mut channel = Channel::connect(&address, Duration::from_secs(5))?;
    let mut peer = listener.accept_timeout(Duration::from_secs(5))?;
    channel.set_timeouts(Duration::from_secs(60))?;
    peer.set_timeouts(Duration::from_secs(60))?;
    let reader = std::thread::spawn(move || -> Result<(), ChannelError> {
        let mut buffer = vec![0u8; 1 << 20];
        let mut left = expected;
        while left > 0 {
            let chunk = crate::numeric::saturating_usize(left.min(buffer.len() as u64));
            peer.read_exact(&mut buffer[..chunk])?;
            left -= chunk as u64;
        }
        Ok(())
    });
    Ok((channel, reader))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measurement_helper_runs() {
        let plain = measure_cpu_per_gib(8 << 20, SendMode::Plain).unwrap();
        assert!(plain.stats.is_none());
        let zero = measure_cpu_per_gib(
            8 << 20,
            SendMode::ZeroCopy {
                window_bytes: 1 << 20,
            },
        )
        .unwrap();
        let stats = zero.stats.unwrap();
        assert_eq!(stats.zero_copy_bytes, 8 << 20);
        assert_eq!(stats.sends_completed, stats.sends_queued);
        assert!(zero.sender_cpu_per_gib() > 0.0);
    }
}
