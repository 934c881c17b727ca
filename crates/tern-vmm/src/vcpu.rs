//! The vCPU thread: runs `KVM_RUN`, emulates the serial port on I/O exits,
//! and can be paused, resumed and throttled from other threads.
//!
//! Pausing: the controlling thread records the request, then kicks the vCPU
//! thread with a real-time signal whose handler (installed with
//! vmm-sys-util, which never sets `SA_RESTART`) sets
//! `kvm_run.immediate_exit`. Whether the signal lands
//! before `KVM_RUN` is entered (the flag makes the ioctl return at once) or
//! during it (the ioctl returns `EINTR`), the vCPU thread leaves the guest.
//! The thread only acknowledges the pause after a `KVM_RUN` returned
//! `EINTR`: KVM completes a pending I/O instruction (advancing RIP past an
//! `out`) when it is re-entered, so after an I/O exit the thread re-enters
//! once with `immediate_exit` set. Saved registers are therefore never in
//! the middle of an instruction, and the destination does not repeat the
//! guest's last `out`.
//!
//! Throttling: a ticker thread kicks the vCPU at the end of each running
//! share of a 20 ms slice; the vCPU thread then sleeps for the throttled
//! share.

use std::cell::Cell;
use std::os::unix::thread::JoinHandleExt;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvm_bindings::{Msrs, kvm_msr_entry, kvm_run};
use kvm_ioctls::{VcpuExit, VcpuFd};
use vmm_sys_util::signal::{Killable, SIGRTMIN, register_signal_handler};

use crate::serial::Serial;
use crate::state::VcpuState;
use crate::{Result, VmmError};

/// Length of one throttling slice.
const THROTTLE_SLICE: Duration = Duration::from_millis(20);
/// How long `pause` waits for the vCPU thread before giving up.
const PAUSE_TIMEOUT: Duration = Duration::from_secs(10);

thread_local! {
    /// This thread's `kvm_run`, for the kick signal's handler.
    static KVM_RUN: Cell<*mut kvm_run> = const { Cell::new(std::ptr::null_mut()) };
}

extern "C" fn kick_handler(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    let _ = KVM_RUN.try_with(|run| {
        let run = run.get();
        if !run.is_null() {
            // SAFETY: the pointer is this thread's own `kvm_run` mapping, set
            // by the vCPU thread while it owns the vCPU and cleared before the
            // vCPU is dropped. A volatile store of one byte is
            // async-signal-safe; the kernel reads the flag on the next
            // KVM_RUN.
            unsafe { std::ptr::addr_of_mut!((*run).immediate_exit).write_volatile(1) };
        }
    });
}

fn kick_signal() -> libc::c_int {
    SIGRTMIN()
}

/// Installs the kick signal's handler once per process.
fn install_kick_handler() -> Result<()> {
    static INSTALLED: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    INSTALLED
        .get_or_init(|| {
            register_signal_handler(kick_signal(), kick_handler).map_err(|error| error.to_string())
        })
        .clone()
        .map_err(|error| {
            VmmError::Thread(format!(
                "cannot install the vCPU kick signal handler: {error}"
            ))
        })
}

/// The vCPU thread as a target of the kick signal, for the throttle's
/// ticker, which does not own the thread's `JoinHandle`.
struct VcpuThread(libc::pthread_t);

// SAFETY: the handle is the vCPU thread's, and the thread outlives every
// `VcpuThread`: the only one lives in the ticker, which `Drop for Vcpu` joins
// before it lets the vCPU thread end.
unsafe impl Killable for VcpuThread {
    fn pthread_handle(&self) -> libc::pthread_t {
        self.0
    }
}

/// What the controller wants the vCPU thread to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Want {
    Run,
    Pause,
    Exit,
}

/// What the vCPU thread is doing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VcpuStatus {
    /// Created, not yet parked.
    Starting,
    /// Out of `KVM_RUN`, waiting to be resumed; state may be saved or
    /// restored.
    Paused,
    /// Running the guest.
    Running,
    /// Stopped on an exit it cannot handle; the reason.
    Failed(String),
    /// The thread has ended.
    Exited,
}

struct Control {
    want: Want,
    status: VcpuStatus,
}

struct Shared {
    control: Mutex<Control>,
    changed: Condvar,
    /// Mirror of `want == Run`, read by the run loop before each KVM_RUN.
    want_run: AtomicBool,
    throttle: AtomicU8,
    throttle_due: AtomicBool,
    ticker_exit: AtomicBool,
    serial: Mutex<Serial>,
    exits: AtomicU64,
}

impl Shared {
    fn control(&self) -> MutexGuard<'_, Control> {
        self.control
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }
}

/// A vCPU and the thread that runs it.
pub struct Vcpu {
    fd: Arc<Mutex<VcpuFd>>,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    ticker: Option<JoinHandle<()>>,
    msr_indices: Vec<u32>,
}

impl std::fmt::Debug for Vcpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vcpu")
            .field("status", &self.status())
            .field("msrs", &self.msr_indices.len())
            .finish()
    }
}

impl Vcpu {
    /// How many MSRs [`Vcpu::save`] reads.
    pub fn msr_count(&self) -> usize {
        self.msr_indices.len()
    }

    /// Starts the thread for an already configured vCPU, paused.
    /// `msr_indices` are the MSRs saved with its state.
    pub fn spawn(fd: VcpuFd, serial: Serial, msr_indices: Vec<u32>) -> Result<Self> {
        install_kick_handler()?;
        let shared = Arc::new(Shared {
            control: Mutex::new(Control {
                want: Want::Pause,
                status: VcpuStatus::Starting,
            }),
            changed: Condvar::new(),
            want_run: AtomicBool::new(false),
            throttle: AtomicU8::new(0),
            throttle_due: AtomicBool::new(false),
            ticker_exit: AtomicBool::new(false),
            serial: Mutex::new(serial),
            exits: AtomicU64::new(0),
        });
        let fd = Arc::new(Mutex::new(fd));
        let thread = {
            let (fd, shared) = (fd.clone(), shared.clone());
            std::thread::Builder::new()
                .name("tern-vcpu0".into())
                .spawn(move || run_loop(&fd, &shared))
                .map_err(|error| VmmError::Thread(format!("cannot start the vCPU: {error}")))?
        };
        let vcpu_thread = VcpuThread(thread.as_pthread_t());
        let ticker = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("tern-throttle".into())
                .spawn(move || ticker_loop(&shared, &vcpu_thread))
                .map_err(|error| VmmError::Thread(format!("cannot start the throttle: {error}")))?
        };
        let vcpu = Self {
            fd,
            shared,
            thread: Some(thread),
            ticker: Some(ticker),
            msr_indices,
        };
        vcpu.wait_until(|status| *status != VcpuStatus::Starting)?;
        Ok(vcpu)
    }

    fn kick(&self) {
        // The thread is alive while its handle is here: it only ends when
        // `Drop` asks it to, after which no kick is sent.
        if let Some(thread) = &self.thread {
            let _ = thread.kill(kick_signal());
        }
    }

    fn wait_until(&self, done: impl Fn(&VcpuStatus) -> bool) -> Result<()> {
        let deadline = Instant::now() + PAUSE_TIMEOUT;
        let mut control = self.shared.control();
        while !done(&control.status) {
            let now = Instant::now();
            if now >= deadline {
                return Err(VmmError::Thread(format!(
                    "the vCPU thread did not respond (status {:?})",
                    control.status
                )));
            }
            if control.want != Want::Run {
                self.kick();
            }
            let wait = (deadline - now).min(Duration::from_millis(10));
            control = self
                .shared
                .changed
                .wait_timeout(control, wait)
                .unwrap_or_else(|poison| poison.into_inner())
                .0;
        }
        Ok(())
    }

    /// The thread's current status.
    pub fn status(&self) -> VcpuStatus {
        self.shared.control().status.clone()
    }

    /// Stops the guest; returns once the vCPU thread is out of `KVM_RUN`
    /// with any pending I/O completed. Pausing a failed vCPU succeeds.
    pub fn pause(&self) -> Result<()> {
        {
            let mut control = self.shared.control();
            control.want = Want::Pause;
            self.shared.want_run.store(false, Ordering::SeqCst);
        }
        self.kick();
        self.wait_until(|status| matches!(status, VcpuStatus::Paused | VcpuStatus::Failed(_)))
    }

    /// Lets the guest run.
    pub fn resume(&self) -> Result<()> {
        let mut control = self.shared.control();
        if let VcpuStatus::Failed(reason) = &control.status {
            return Err(VmmError::VcpuStopped(reason.clone()));
        }
        control.want = Want::Run;
        self.shared.want_run.store(true, Ordering::SeqCst);
        self.shared.changed.notify_all();
        Ok(())
    }

    /// Takes `percent` of the vCPU's time away (0 = full speed, max 99).
    pub fn set_throttle(&self, percent: u8) {
        self.shared
            .throttle
            .store(percent.min(99), Ordering::Relaxed);
        self.shared.changed.notify_all();
    }

    /// The current throttle.
    pub fn throttle(&self) -> u8 {
        self.shared.throttle.load(Ordering::Relaxed)
    }

    /// Runs `f` on the serial port.
    pub fn with_serial<T>(&self, f: impl FnOnce(&mut Serial) -> T) -> T {
        f(&mut self
            .shared
            .serial
            .lock()
            .unwrap_or_else(|poison| poison.into_inner()))
    }

    /// Exits handled so far (I/O and kicks).
    pub fn exits(&self) -> u64 {
        self.shared.exits.load(Ordering::Relaxed)
    }

    fn paused_fd(&self) -> Result<MutexGuard<'_, VcpuFd>> {
        if !matches!(
            self.status(),
            VcpuStatus::Paused | VcpuStatus::Failed(_) | VcpuStatus::Starting
        ) {
            return Err(VmmError::NotPaused);
        }
        Ok(self.fd.lock().unwrap_or_else(|poison| poison.into_inner()))
    }

    /// The instruction pointer the guest resumes at. The vCPU must be
    /// paused.
    pub fn instruction_pointer(&self) -> Result<u64> {
        let fd = self.paused_fd()?;
        Ok(fd.get_regs().map_err(VmmError::kvm("get registers"))?.rip)
    }

    /// Saves the vCPU's state. The vCPU must be paused.
    pub fn save(&self) -> Result<VcpuState> {
        let fd = self.paused_fd()?;
        let mut msrs = Msrs::from_entries(
            &self
                .msr_indices
                .iter()
                .map(|&index| kvm_msr_entry {
                    index,
                    ..Default::default()
                })
                .collect::<Vec<_>>(),
        )
        .map_err(|error| VmmError::Thread(format!("MSR list: {error:?}")))?;
        let read = fd.get_msrs(&mut msrs).map_err(VmmError::kvm("get MSRs"))?;
        if read != self.msr_indices.len() {
            return Err(VmmError::Config(format!(
                "read {read} of {} MSRs",
                self.msr_indices.len()
            )));
        }
        Ok(VcpuState {
            regs: fd.get_regs().map_err(VmmError::kvm("get registers"))?,
            sregs: fd
                .get_sregs()
                .map_err(VmmError::kvm("get special registers"))?,
            xsave: fd.get_xsave().map_err(VmmError::kvm("get XSAVE"))?,
            xcrs: fd.get_xcrs().map_err(VmmError::kvm("get XCRs"))?,
            msrs: msrs
                .as_slice()
                .iter()
                .map(|entry| (entry.index, entry.data))
                .collect(),
            lapic: fd.get_lapic().map_err(VmmError::kvm("get LAPIC"))?,
            events: fd
                .get_vcpu_events()
                .map_err(VmmError::kvm("get vCPU events"))?,
            mp_state: fd.get_mp_state().map_err(VmmError::kvm("get MP state"))?,
            debugregs: fd
                .get_debug_regs()
                .map_err(VmmError::kvm("get debug registers"))?,
        })
    }

    /// Restores a saved state. The vCPU must be paused and not have run
    /// since it was created (a destination vCPU).
    ///
    /// Order matters: special registers first (they set the mode and the
    /// APIC base the others are interpreted against), then the general
    /// registers and the FPU, then the LAPIC (after its base), the MSRs,
    /// pending events, and the MP state last.
    pub fn restore(&self, state: &VcpuState) -> Result<()> {
        let fd = self.paused_fd()?;
        fd.set_sregs(&state.sregs)
            .map_err(VmmError::kvm("set special registers"))?;
        fd.set_regs(&state.regs)
            .map_err(VmmError::kvm("set registers"))?;
        // SAFETY: `kvm_xsave` is the legacy 4 KiB buffer; the VM was checked
        // at creation to need no larger one (KVM_CAP_XSAVE2 <= 4096), so the
        // kernel reads no further than the structure.
        unsafe { fd.set_xsave(&state.xsave) }.map_err(VmmError::kvm("set XSAVE"))?;
        fd.set_xcrs(&state.xcrs)
            .map_err(VmmError::kvm("set XCRs"))?;
        fd.set_lapic(&state.lapic)
            .map_err(VmmError::kvm("set LAPIC"))?;
        set_msrs(&fd, &state.msrs)?;
        fd.set_vcpu_events(&state.events)
            .map_err(VmmError::kvm("set vCPU events"))?;
        fd.set_debug_regs(&state.debugregs)
            .map_err(VmmError::kvm("set debug registers"))?;
        fd.set_mp_state(state.mp_state)
            .map_err(VmmError::kvm("set MP state"))?;
        Ok(())
    }
}

/// Sets MSRs, skipping the ones this host's KVM refuses to set (KVM stops
/// at the first refusal and reports how many it set).
fn set_msrs(fd: &VcpuFd, msrs: &[(u32, u64)]) -> Result<()> {
    let entries: Vec<kvm_msr_entry> = msrs
        .iter()
        .map(|&(index, data)| kvm_msr_entry {
            index,
            data,
            ..Default::default()
        })
        .collect();
    let mut rest = entries.as_slice();
    while !rest.is_empty() {
        let list = Msrs::from_entries(rest)
            .map_err(|error| VmmError::Thread(format!("MSR list: {error:?}")))?;
        let set = fd.set_msrs(&list).map_err(VmmError::kvm("set MSRs"))?;
        if set < rest.len() {
            tracing::debug!(
                msr = format_args!("{:#x}", rest[set].index),
                "MSR not settable, skipped"
            );
            rest = &rest[set + 1..];
        } else {
            rest = &[];
        }
    }
    Ok(())
}

impl Drop for Vcpu {
    fn drop(&mut self) {
        self.shared.ticker_exit.store(true, Ordering::SeqCst);
        self.shared.changed.notify_all();
        if let Some(ticker) = self.ticker.take() {
            let _ = ticker.join();
        }
        {
            let mut control = self.shared.control();
            control.want = Want::Exit;
            self.shared.want_run.store(false, Ordering::SeqCst);
            self.shared.changed.notify_all();
        }
        self.kick();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn set_status(shared: &Shared, control: &mut Control, status: VcpuStatus) {
    if control.status != status {
        control.status = status;
        shared.changed.notify_all();
    }
}

/// Waits while the vCPU is to stay out of the guest. Returns false when the
/// thread is to end.
fn park(shared: &Shared) -> bool {
    let mut control = shared.control();
    loop {
        if matches!(control.status, VcpuStatus::Failed(_)) {
            if control.want == Want::Exit {
                return false;
            }
        } else {
            match control.want {
                Want::Run => {
                    set_status(shared, &mut control, VcpuStatus::Running);
                    return true;
                }
                Want::Pause => set_status(shared, &mut control, VcpuStatus::Paused),
                Want::Exit => return false,
            }
        }
        control = shared
            .changed
            .wait(control)
            .unwrap_or_else(|poison| poison.into_inner());
    }
}

fn run_loop(fd: &Mutex<VcpuFd>, shared: &Shared) {
    {
        let mut vcpu = fd.lock().unwrap_or_else(|poison| poison.into_inner());
        let run: *mut kvm_run = vcpu.get_kvm_run();
        KVM_RUN.with(|cell| cell.set(run));
    }
    // Whether the last KVM_RUN left no I/O pending (true before the first).
    let mut settled = true;
    loop {
        if settled && !park(shared) {
            break;
        }
        let mut vcpu = fd.lock().unwrap_or_else(|poison| poison.into_inner());
        if !shared.want_run.load(Ordering::SeqCst) {
            // Complete pending I/O and come straight back out.
            vcpu.set_kvm_immediate_exit(1);
        }
        let outcome = match vcpu.run() {
            Err(error) if error.errno() == libc::EINTR || error.errno() == libc::EAGAIN => {
                settled = true;
                Ok(())
            }
            Ok(VcpuExit::IoOut(port, data)) => {
                settled = false;
                if Serial::handles(port) {
                    let mut serial = shared
                        .serial
                        .lock()
                        .unwrap_or_else(|poison| poison.into_inner());
                    for &byte in data {
                        serial.write(port, byte);
                    }
                }
                Ok(())
            }
            Ok(VcpuExit::IoIn(port, data)) => {
                settled = false;
                let value = if Serial::handles(port) {
                    shared
                        .serial
                        .lock()
                        .unwrap_or_else(|poison| poison.into_inner())
                        .read(port)
                } else {
                    0xff
                };
                data.fill(value);
                Ok(())
            }
            Ok(VcpuExit::Hlt) => Err("the guest halted".to_owned()),
            Ok(VcpuExit::Shutdown) => Err("the guest shut down (triple fault)".to_owned()),
            Ok(other) => Err(format!("unhandled exit {other:?}")),
            Err(error) => Err(format!("KVM_RUN failed: {error}")),
        };
        vcpu.set_kvm_immediate_exit(0);
        drop(vcpu);
        shared.exits.fetch_add(1, Ordering::Relaxed);
        if let Err(reason) = outcome {
            tracing::warn!("vCPU stopped: {reason}");
            let mut control = shared.control();
            set_status(shared, &mut control, VcpuStatus::Failed(reason));
            settled = true;
            continue;
        }
        if shared.throttle_due.swap(false, Ordering::Relaxed) {
            let percent = u32::from(shared.throttle.load(Ordering::Relaxed));
            if percent > 0 && shared.want_run.load(Ordering::SeqCst) {
                std::thread::sleep(THROTTLE_SLICE * percent / 100);
            }
        }
    }
    KVM_RUN.with(|cell| cell.set(std::ptr::null_mut()));
    let mut control = shared.control();
    set_status(shared, &mut control, VcpuStatus::Exited);
}

fn ticker_loop(shared: &Shared, vcpu_thread: &VcpuThread) {
    while !shared.ticker_exit.load(Ordering::SeqCst) {
        let percent = u32::from(shared.throttle.load(Ordering::Relaxed));
        if percent == 0 {
            let control = shared.control();
            let _ = shared
                .changed
                .wait_timeout(control, Duration::from_millis(50));
            continue;
        }
        std::thread::sleep(THROTTLE_SLICE * (100 - percent) / 100);
        if shared.want_run.load(Ordering::SeqCst) && !shared.ticker_exit.load(Ordering::SeqCst) {
            shared.throttle_due.store(true, Ordering::Relaxed);
            let _ = vcpu_thread.kill(kick_signal());
        }
        std::thread::sleep(THROTTLE_SLICE * percent / 100);
    }
}
