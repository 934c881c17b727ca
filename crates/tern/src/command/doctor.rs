//! `tern doctor`: what this machine offers tern, and the fix for what is
//! missing.
//!
//! Every check is split in two: reading the machine (sysfs, /proc, a probe
//! syscall) and a pure decision from what was read, so the decisions are
//! unit-tested with the outputs of machines we do not have.

use std::path::Path;

use serde::Serialize;

/// How a topic stands on this machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum Status {
    /// Present and usable.
    Ok,
    /// Usable with a restriction worth knowing.
    Limited,
    /// Absent or unusable: the feature falls back (or refuses).
    Missing,
}

impl Status {
    fn label(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Limited => "limited",
            Self::Missing => "missing",
        }
    }
}

/// One line of the report.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub(crate) struct Finding {
    /// What was checked: `kvm`, `dsa`, `iaa`, `qpl`, `ktls`, `io-uring`,
    /// `memlock`, `thp`, `numa`, `cpu`.
    pub topic: &'static str,
    /// How it stands.
    pub status: Status,
    /// What was found.
    pub detail: String,
    /// What to do about it, when something can be done.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
}

impl Finding {
    fn new(topic: &'static str, status: Status, detail: impl Into<String>) -> Self {
        Self {
            topic,
            status,
            detail: detail.into(),
            fix: None,
        }
    }

    fn fix(mut self, fix: impl Into<String>) -> Self {
        self.fix = Some(fix.into());
        self
    }
}

/// Runs every check on this machine.
pub(crate) fn examine() -> Vec<Finding> {
    let cpu_flags = read("/proc/cpuinfo")
        .and_then(|text| {
            text.lines()
                .find_map(|line| line.strip_prefix("flags"))
                .map(|flags| flags.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_default();
    let flags: Vec<&str> = cpu_flags.split_whitespace().collect();
    let modules = loaded_modules();
    let submit = tern_dsa::CpuSubmitFeatures::detect();
    vec![
        kvm_finding(
            kvm_access(),
            &modules.iter().map(String::as_str).collect::<Vec<_>>(),
            &flags,
        ),
        cpu_finding(submit.movdir64b, submit.enqcmd, submit.waitpkg),
        iommu_finding(
            read("/proc/cmdline").as_deref(),
            &sva_states(Path::new("/sys/bus/dsa")),
        ),
        rawio_finding(has_cap_sys_rawio()),
        dsa_finding(Path::new("/sys/bus/dsa"), Path::new("/dev/dsa")),
        iaa_finding(Path::new("/sys/bus/dsa"), Path::new("/dev/iax")),
        accel_config_finding(libaccel_config_loads()),
        qpl_finding(tern_page::codec::qpl_available().map_err(|error| error.to_string())),
        qpl_hardware_finding(qpl_hardware_probe()),
        ktls_finding(
            read("/proc/sys/net/ipv4/tcp_available_ulp").as_deref(),
            tls_module_installed(),
        ),
        io_uring_finding(
            tern_engine::uring_zc::check_available().map_err(|error| error.to_string()),
        ),
        memlock_finding(memlock_limit(), tern_engine::zerocopy::has_cap_ipc_lock()),
        thp_finding(read("/sys/kernel/mm/transparent_hugepage/enabled").as_deref()),
        numa_finding(read("/sys/devices/system/node/online").as_deref()),
    ]
}

/// Prints the findings as a table, or as one JSON document.
pub(crate) fn print(findings: &[Finding], json: bool) -> anyhow::Result<()> {
    if json {
        let document = serde_json::json!({ "findings": findings });
        println!("{}", serde_json::to_string_pretty(&document)?);
        return Ok(());
    }
    for finding in findings {
        println!(
            "{:<8} {:<12} {}",
            finding.status.label(),
            finding.topic,
            finding.detail
        );
        if let Some(fix) = &finding.fix {
            println!("{:<21} fix: {fix}", "");
        }
    }
    Ok(())
}

fn read(path: &str) -> Option<String> {
    std::fs::read_to_string(path).ok()
}

fn loaded_modules() -> Vec<String> {
    std::fs::read_dir("/sys/module")
        .map(|entries| {
            entries
                .flatten()
                .map(|entry| entry.file_name().to_string_lossy().into_owned())
                .filter(|name| name.starts_with("kvm"))
                .collect()
        })
        .unwrap_or_default()
}

fn kvm_access() -> Result<(), String> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .map(drop)
        .map_err(|error| error.to_string())
}

/// Whether guests can run, and how fast: natively with VT-x/AMD-V, or under
/// PVM, where a guest that is not paravirtualized is emulated.
pub(crate) fn kvm_finding(
    access: Result<(), String>,
    kvm_modules: &[&str],
    cpu_flags: &[&str],
) -> Finding {
    if let Err(error) = access {
        return Finding::new("kvm", Status::Missing, format!("/dev/kvm: {error}")).fix(
            "load kvm_intel or kvm_amd (hardware virtualization enabled in firmware) and \
             add this user to the kvm group; `tern vm` and the KVM tests need it",
        );
    }
    let native = kvm_modules
        .iter()
        .any(|module| matches!(*module, "kvm_intel" | "kvm_amd"));
    let nested = cpu_flags.contains(&"hypervisor");
    if native {
        let place = if nested { " (nested, inside a VM)" } else { "" };
        return Finding::new(
            "kvm",
            Status::Ok,
            format!("/dev/kvm usable, hardware virtualization{place}: guests run natively"),
        );
    }
    if kvm_modules.contains(&"kvm_pvm") {
        return Finding::new(
            "kvm",
            Status::Limited,
            "/dev/kvm usable through PVM (no VT-x/AMD-V here): a guest that is not \
             paravirtualized is emulated, a few million instructions per second",
        )
        .fix("fine for tern's memory-dirtying test guests; for real guests use a host with hardware virtualization");
    }
    Finding::new(
        "kvm",
        Status::Limited,
        format!(
            "/dev/kvm usable, provider unknown (modules: {})",
            kvm_modules.join(", ")
        ),
    )
}

/// The CPU instructions the DSA path submits and waits with.
pub(crate) fn cpu_finding(movdir64b: bool, enqcmd: bool, waitpkg: bool) -> Finding {
    let yes_no = |present: bool| if present { "yes" } else { "no" };
    let detail = format!(
        "MOVDIR64B {}, ENQCMD {}, WAITPKG {}",
        yes_no(movdir64b),
        yes_no(enqcmd),
        yes_no(waitpkg)
    );
    if movdir64b && enqcmd {
        return Finding::new("cpu", Status::Ok, detail);
    }
    Finding::new("cpu", Status::Limited, detail).fix(
        "without MOVDIR64B/ENQCMD tern submits DSA descriptors with write() on the queue's \
         device file: one descriptor per page, no batches (several descriptors per write() \
         call); these instructions come with 4th-gen Xeon and later",
    )
}

/// Lists accelerator devices named `prefix`N under `/sys/bus/dsa/devices`.
fn accelerator_devices(sysfs_root: &Path, prefix: &str) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(sysfs_root.join("devices"))
        .map(|entries| {
            entries
                .flatten()
                .map(|entry| entry.file_name().to_string_lossy().into_owned())
                .filter(|name| {
                    name.strip_prefix(prefix).is_some_and(|rest| {
                        !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit())
                    })
                })
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// Each accelerator device with its `pasid_enabled` (None: the kernel does
/// not publish it).
fn sva_states(sysfs_root: &Path) -> Vec<(String, Option<bool>)> {
    let mut devices = accelerator_devices(sysfs_root, "dsa");
    devices.extend(accelerator_devices(sysfs_root, "iax"));
    devices
        .into_iter()
        .map(|name| {
            let value = std::fs::read_to_string(
                sysfs_root.join("devices").join(&name).join("pasid_enabled"),
            )
            .ok()
            .map(|text| text.trim() == "1");
            (name, value)
        })
        .collect()
}

/// Whether the kernel command line asks for the IOMMU in scalable mode:
/// `intel_iommu=` with both `on` and `sm_on` among its values.
fn cmdline_has_scalable_mode(cmdline: &str) -> bool {
    cmdline.split_whitespace().any(|word| {
        word.strip_prefix("intel_iommu=").is_some_and(|values| {
            let values: Vec<&str> = values.split(',').collect();
            values.contains(&"on") && values.contains(&"sm_on")
        })
    })
}

/// The fix for an IOMMU not in scalable mode.
const SVA_FIX: &str = "enable VT-d in the firmware (BIOS), add intel_iommu=on,sm_on to the \
                       kernel command line (GRUB_CMDLINE_LINUX, then update-grub or \
                       grub2-mkconfig), reboot; each device's pasid_enabled must then read 1";

/// Shared virtual addressing, which user work queues need: the IOMMU in
/// scalable mode, seen as each device's `pasid_enabled`.
pub(crate) fn iommu_finding(cmdline: Option<&str>, devices: &[(String, Option<bool>)]) -> Finding {
    let asked = cmdline.is_some_and(cmdline_has_scalable_mode);
    let off: Vec<&str> = devices
        .iter()
        .filter(|(_, sva)| *sva == Some(false))
        .map(|(name, _)| name.as_str())
        .collect();
    if !off.is_empty() {
        return Finding::new(
            "iommu",
            Status::Missing,
            format!(
                "shared virtual addressing off (pasid_enabled 0) on {}{}",
                off.join(", "),
                if asked {
                    "; the command line asks for scalable mode, so check VT-d in the firmware and `dmesg | grep -i -e DMAR -e IOMMU`"
                } else {
                    "; intel_iommu=on,sm_on is not on the kernel command line"
                }
            ),
        )
        .fix(SVA_FIX);
    }
    if devices.is_empty() {
        let detail = if asked {
            "intel_iommu=on,sm_on on the kernel command line; no DSA/IAA device to check"
        } else {
            "no DSA/IAA device; intel_iommu=on,sm_on is not on the kernel command line"
        };
        let finding = Finding::new(
            "iommu",
            if asked { Status::Ok } else { Status::Missing },
            detail,
        );
        return if asked { finding } else { finding.fix(SVA_FIX) };
    }
    let on: Vec<&str> = devices
        .iter()
        .filter(|(_, sva)| *sva == Some(true))
        .map(|(name, _)| name.as_str())
        .collect();
    if on.len() == devices.len() {
        return Finding::new(
            "iommu",
            Status::Ok,
            format!(
                "shared virtual addressing on (pasid_enabled 1) for {}",
                on.join(", ")
            ),
        );
    }
    Finding::new(
        "iommu",
        if asked { Status::Ok } else { Status::Limited },
        "this kernel does not publish pasid_enabled; the kernel refuses to enable a user work \
         queue without SVA",
    )
}

/// Whether this process has CAP_SYS_RAWIO (bit 17 of CapEff).
fn has_cap_sys_rawio() -> bool {
    read("/proc/self/status")
        .and_then(|status| {
            status.lines().find_map(|line| {
                let hex = line.strip_prefix("CapEff:")?.trim();
                u64::from_str_radix(hex, 16).ok()
            })
        })
        .is_some_and(|caps| caps & (1 << 17) != 0)
}

/// CAP_SYS_RAWIO, which Sapphire and Emerald Rapids need for the fast path.
pub(crate) fn rawio_finding(cap_sys_rawio: bool) -> Finding {
    if cap_sys_rawio {
        return Finding::new(
            "rawio",
            Status::Ok,
            "CAP_SYS_RAWIO: work-queue portals can be mapped (MOVDIR64B/ENQCMD with batches)",
        );
    }
    Finding::new(
        "rawio",
        Status::Limited,
        "no CAP_SYS_RAWIO: on Sapphire and Emerald Rapids the kernel refuses to map work-queue \
         portals without it (INTEL-SA-01084), so DSA goes through write(): one descriptor per \
         page, no batches, possibly slower than the CPU",
    )
    .fix("run tern as root, or `sudo setcap cap_sys_rawio+ep $(command -v tern)`")
}

/// How tern would submit to `queue`, and why, found by opening it (and
/// closing it at once: no descriptor is sent).
fn submission_of(queue: &tern_dsa::WorkQueueInfo) -> (String, bool) {
    use tern_dsa::{DsaQueue, SubmissionMethod};
    match tern_dsa::HardwareQueue::open(queue, false, 1) {
        Err(tern_dsa::DsaError::QueueBusy { .. }) => {
            ("dedicated, held by another process".to_string(), false)
        }
        Err(error) => (format!("cannot open: {error}"), false),
        Ok(opened) => match (opened.method(), opened.portal_refused()) {
            (SubmissionMethod::Movdir64b, _) => (
                format!(
                    "MOVDIR64B to the portal, batches of {}",
                    opened.max_batch_size()
                ),
                true,
            ),
            (SubmissionMethod::Enqcmd, _) => (
                format!(
                    "ENQCMD to the portal, batches of {}",
                    opened.max_batch_size()
                ),
                true,
            ),
            (_, Some(error)) if error.raw_os_error() == Some(libc::EPERM) => (
                "write(): portal mmap refused (EPERM, no CAP_SYS_RAWIO), one descriptor per \
                 page, no batches"
                    .to_string(),
                false,
            ),
            (_, Some(error)) => (
                format!("write(): portal mmap refused ({error}), one descriptor per page"),
                false,
            ),
            (_, None) => (
                "write(): the CPU lacks MOVDIR64B/ENQCMD, one descriptor per page".to_string(),
                false,
            ),
        },
    }
}

/// The devices under `sysfs_root` named `prefix`N with their state, for a
/// report that found no usable queue.
fn device_states(sysfs_root: &Path, prefix: &str) -> String {
    let devices = accelerator_devices(sysfs_root, prefix);
    if devices.is_empty() {
        return "none".to_string();
    }
    devices
        .iter()
        .map(|name| {
            let state =
                std::fs::read_to_string(sysfs_root.join("devices").join(name).join("state"))
                    .map_or_else(|_| "state unknown".to_string(), |s| s.trim().to_string());
            format!("{name} ({state})")
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The accel-config recipe for a shared user queue on `device`.
fn queue_recipe(device: &str) -> String {
    let queue = format!(
        "wq{}.0",
        device.trim_start_matches(|c: char| c.is_ascii_alphabetic())
    );
    format!(
        "configure a shared user queue (docs/hardware.md): accel-config config-engine \
         {device}/engine{n}.0 --group-id=0; accel-config config-wq {device}/{queue} --group-id=0 \
         --mode=shared --type=user --name=tern --driver-name=user --priority=10 --wq-size=128 \
         --threshold=128; accel-config enable-device {device}; accel-config enable-wq \
         {device}/{queue}",
        n = device.trim_start_matches(|c: char| c.is_ascii_alphabetic()),
    )
}

/// No enabled user work queue: the devices' states, and the recipe for a
/// queue on the first device.
fn no_dsa_queue_finding(sysfs_root: &Path) -> Finding {
    let devices = accelerator_devices(sysfs_root, "dsa");
    let finding = Finding::new(
        "dsa",
        Status::Missing,
        format!(
            "no enabled user work queue; DSA devices: {}",
            device_states(sysfs_root, "dsa")
        ),
    );
    match devices.first() {
        Some(device) => finding.fix(queue_recipe(device)),
        None => finding.fix("no DSA device: check VT-d in the firmware and `dmesg | grep idxd`"),
    }
}

/// DSA work queues tern can open, and how it would submit to each.
pub(crate) fn dsa_finding(sysfs_root: &Path, dev_root: &Path) -> Finding {
    if !sysfs_root.exists() {
        return Finding::new(
            "dsa",
            Status::Missing,
            format!(
                "no {} (no idxd driver or no DSA device)",
                sysfs_root.display()
            ),
        )
        .fix(
            "needs Intel DSA (4th-gen Xeon or later, VT-d on in firmware, intel_iommu=on,sm_on), \
             `modprobe idxd`, and a user work queue (docs/hardware.md); zero pages are found \
             on the CPU meanwhile",
        );
    }
    let queues = match tern_dsa::sysfs::discover_work_queues(sysfs_root, dev_root) {
        Ok(queues) => queues,
        Err(error @ tern_dsa::DsaError::NoSva { .. }) => {
            return Finding::new("dsa", Status::Missing, error.to_string()).fix(SVA_FIX);
        }
        Err(_) => return no_dsa_queue_finding(sysfs_root),
    };
    let mut unusable = Vec::new();
    let mut slow = false;
    let listed: Vec<String> = queues
        .iter()
        .map(|queue| {
            let how = if is_read_write(&queue.dev_path) {
                let (how, fast) = submission_of(queue);
                slow |= !fast;
                how
            } else {
                unusable.push(queue.dev_path.display().to_string());
                "no access".to_string()
            };
            format!(
                "{} ({}, size {}, node {}: {how})",
                queue.full_name(),
                queue.mode.name(),
                queue.size,
                queue
                    .numa_node
                    .map_or_else(|| "?".to_string(), |node| node.to_string())
            )
        })
        .collect();
    let status = if unusable.is_empty() && !slow {
        Status::Ok
    } else {
        Status::Limited
    };
    let finding = Finding::new("dsa", status, listed.join("; "));
    if !unusable.is_empty() {
        finding.fix(format!(
            "grant this user read/write on {} (the udev rule in docs/hardware.md)",
            unusable.join(", ")
        ))
    } else if slow {
        finding.fix(
            "see the rawio and cpu lines: the portal path needs CAP_SYS_RAWIO on Sapphire/Emerald \
             Rapids and MOVDIR64B/ENQCMD",
        )
    } else {
        finding
    }
}

fn is_read_write(path: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(path) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: `path` is a valid NUL-terminated string; access() only reads it.
    unsafe { libc::access(path.as_ptr(), libc::R_OK | libc::W_OK) == 0 }
}

/// IAA work queues for QPL's hardware path: QPL submits to shared user
/// queues it can open.
pub(crate) fn iaa_finding(sysfs_root: &Path, dev_root: &Path) -> Finding {
    let queues = match tern_dsa::discover_iaa_work_queues(sysfs_root, dev_root) {
        Ok(queues) => queues,
        Err(error @ tern_dsa::DsaError::NoSva { .. }) => {
            return Finding::new("iaa", Status::Missing, error.to_string()).fix(SVA_FIX);
        }
        Err(_) => {
            let devices = accelerator_devices(sysfs_root, "iax");
            let finding = Finding::new(
                "iaa",
                Status::Missing,
                format!(
                    "no enabled user work queue; IAA devices: {}",
                    device_states(sysfs_root, "iax")
                ),
            );
            return match devices.first() {
                Some(device) => finding.fix(queue_recipe(device)),
                None => finding.fix(
                    "no IAA device (4th-gen Xeon or later); QPL's software path works without it",
                ),
            };
        }
    };
    let usable: Vec<&tern_dsa::WorkQueueInfo> = queues
        .iter()
        .filter(|queue| queue.mode == tern_dsa::WqMode::Shared && is_read_write(&queue.dev_path))
        .collect();
    let listed: Vec<String> = queues.iter().map(describe_iaa_queue).collect();
    let detail = listed.join("; ");
    if usable.is_empty() {
        return Finding::new("iaa", Status::Missing, detail).fix(
            "QPL needs a shared user queue (--mode=shared) with read/write access on /dev/iax/wq*: \
             see docs/hardware.md",
        );
    }
    // QPL's default build (BLOCK_ON_FAULT=ON) asks for block-on-fault on
    // every IAA queue; without it a page fault fails the job and the page
    // goes to the CPU.
    match usable
        .iter()
        .find(|queue| queue.block_on_fault == Some(false))
    {
        Some(queue) => Finding::new("iaa", Status::Limited, detail).fix(format!(
            "QPL's default build needs block-on-fault on its IAA queues: `accel-config \
             disable-wq {name} && accel-config config-wq {name} --block-on-fault=1 && \
             accel-config enable-wq {name}` (docs/hardware.md)",
            name = queue.full_name()
        )),
        None => Finding::new("iaa", Status::Ok, detail),
    }
}

/// One IAA queue as the doctor lists it, with what keeps QPL from it.
fn describe_iaa_queue(queue: &tern_dsa::WorkQueueInfo) -> String {
    let shared = queue.mode == tern_dsa::WqMode::Shared;
    format!(
        "{} ({}, size {}{}{}{})",
        queue.full_name(),
        queue.mode.name(),
        queue.size,
        if shared { "" } else { ", QPL needs shared" },
        if is_read_write(&queue.dev_path) {
            ""
        } else {
            ", no access"
        },
        match queue.block_on_fault {
            Some(false) => ", block-on-fault off",
            _ => "",
        }
    )
}

/// Whether libaccel-config, which QPL's hardware path loads, can be loaded.
fn libaccel_config_loads() -> bool {
    ["libaccel-config.so.1", "libaccel-config.so"]
        .iter()
        .any(|name| {
            let name = std::ffi::CString::new(*name).expect("no NUL");
            // SAFETY: dlopen with a valid C string; the handle is closed at once.
            unsafe {
                let handle = libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
                if handle.is_null() {
                    false
                } else {
                    libc::dlclose(handle);
                    true
                }
            }
        })
}

/// libaccel-config, through which QPL finds IAA queues.
pub(crate) fn accel_config_finding(loads: bool) -> Finding {
    if loads {
        return Finding::new("accel-config", Status::Ok, "libaccel-config loads");
    }
    Finding::new(
        "accel-config",
        Status::Missing,
        "libaccel-config.so.1 not found: QPL's hardware path cannot find IAA queues",
    )
    .fix("install accel-config (package accel-config / libaccel-config1, or build intel/idxd-config)")
}

/// Initialises a QPL job on the hardware path (QPL opens the IAA queues
/// there) and frees it: no job runs.
fn qpl_hardware_probe() -> Result<(), String> {
    tern_page::codec::QplCompressor::new(tern_page::codec::QplPath::Hardware, 1)
        .map(drop)
        .map_err(|error| error.to_string())
}

/// Whether QPL's hardware path initialises.
pub(crate) fn qpl_hardware_finding(probe: Result<(), String>) -> Finding {
    match probe {
        Ok(()) => Finding::new(
            "qpl-hw",
            Status::Ok,
            "QPL initialised a hardware-path job (none was run)",
        ),
        Err(error) => Finding::new("qpl-hw", Status::Missing, error).fix(
            "see the iaa and accel-config lines; `--qpl-path auto` then compresses on the CPU",
        ),
    }
}

/// The QPL library that `--compression qpl` loads at run time.
pub(crate) fn qpl_finding(available: Result<(), String>) -> Finding {
    match available {
        Ok(()) => Finding::new("qpl", Status::Ok, "libqpl loads"),
        Err(error) => Finding::new("qpl", Status::Missing, error).fix(
            "install Intel QPL (libqpl.so.1: tern's bench/install-qpl.sh puts 1.9.0 in /opt/qpl, then TERN_QPL_LIB=/opt/qpl/lib/libqpl.so.1); the other codecs need nothing",
        ),
    }
}

fn tls_module_installed() -> bool {
    let Some(release) = read("/proc/sys/kernel/osrelease") else {
        return false;
    };
    let dir = format!("/lib/modules/{}/kernel/net/tls", release.trim());
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .any(|entry| entry.file_name().to_string_lossy().starts_with("tls.ko"))
        })
        .unwrap_or(false)
}

/// Kernel TLS, which lets encrypted page data leave with one `sendmsg`.
pub(crate) fn ktls_finding(available_ulps: Option<&str>, module_installed: bool) -> Finding {
    let ulps = available_ulps.unwrap_or("").trim();
    if ulps.split_whitespace().any(|ulp| ulp == "tls") {
        return Finding::new("ktls", Status::Ok, format!("TCP ULPs: {ulps}"));
    }
    let finding = Finding::new(
        "ktls",
        Status::Missing,
        format!(
            "no \"tls\" TCP ULP (available: {})",
            if ulps.is_empty() { "none" } else { ulps }
        ),
    );
    if module_installed {
        finding.fix("`modprobe tls`")
    } else {
        finding
            .fix("this kernel has no tls module (CONFIG_TLS); encryption would run in user space")
    }
}

/// io_uring `SENDMSG_ZC`, one of the two zero-copy backends.
pub(crate) fn io_uring_finding(available: Result<(), String>) -> Finding {
    match available {
        Ok(()) => Finding::new("io-uring", Status::Ok, "SENDMSG_ZC supported"),
        Err(error) => Finding::new("io-uring", Status::Missing, error)
            .fix("use --zero-copy-backend msg (MSG_ZEROCOPY), the default"),
    }
}

fn memlock_limit() -> Option<u64> {
    // SAFETY: an all-zero rlimit is a valid value to overwrite.
    let mut limit: libc::rlimit = unsafe { std::mem::zeroed() };
    // SAFETY: `limit` is valid for writes.
    let result = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) };
    (result == 0 && limit.rlim_cur != libc::RLIM_INFINITY).then_some(limit.rlim_cur)
}

/// Zero-copy keeps sent pages pinned until the NIC is done with them, and
/// the kernel charges them to `RLIMIT_MEMLOCK`. 16 MiB per channel is what
/// the engine prefers; `None` is unlimited.
pub(crate) fn memlock_finding(limit: Option<u64>, cap_ipc_lock: bool) -> Finding {
    const PREFERRED_PER_CHANNEL: u64 = 16 << 20;
    const SMALLEST_WINDOW: u64 = 256 << 10;
    if cap_ipc_lock || limit.is_none() {
        let why = if cap_ipc_lock {
            "CAP_IPC_LOCK"
        } else {
            "RLIMIT_MEMLOCK unlimited"
        };
        return Finding::new(
            "memlock",
            Status::Ok,
            format!("{why}: zero-copy windows of 16 MiB per channel"),
        );
    }
    let limit = limit.unwrap_or(0);
    let human = crate::units::human_bytes(limit);
    let channels = limit / PREFERRED_PER_CHANNEL;
    if channels >= 8 {
        return Finding::new(
            "memlock",
            Status::Ok,
            format!("RLIMIT_MEMLOCK {human}: 16 MiB zero-copy windows for {channels} channels"),
        );
    }
    // The kernel charges zero-copy pins to the user (every process of the
    // same uid shares the limit), not to this process alone.
    let fix = "raise it: `ulimit -l unlimited` in the shell, LimitMEMLOCK=infinity in a systemd \
               unit, or grant CAP_IPC_LOCK; the kernel charges zero-copy pins to the user, so \
               every tern running as this user shares the limit";
    if limit < SMALLEST_WINDOW {
        return Finding::new(
            "memlock",
            Status::Missing,
            format!("RLIMIT_MEMLOCK {human}: too small for --zero-copy"),
        )
        .fix(fix);
    }
    Finding::new(
        "memlock",
        Status::Limited,
        format!("RLIMIT_MEMLOCK {human}: --zero-copy windows shrink to share it between channels"),
    )
    .fix(fix)
}

/// Transparent huge pages decide what a destination's first touch costs.
pub(crate) fn thp_finding(enabled: Option<&str>) -> Finding {
    let Some(text) = enabled else {
        return Finding::new(
            "thp",
            Status::Ok,
            "no transparent huge pages in this kernel",
        );
    };
    let mode = text
        .split_whitespace()
        .find_map(|word| word.strip_prefix('[')?.strip_suffix(']'))
        .unwrap_or("unknown");
    match mode {
        "always" => Finding::new(
            "thp",
            Status::Limited,
            "always: a destination's first touch zeroes 2 MiB at a time, which QEMU pays \
             and tern does not ask for",
        )
        .fix("`madvise` (echo madvise > /sys/kernel/mm/transparent_hugepage/enabled) compares both tools on equal footing"),
        other => Finding::new(
            "thp",
            Status::Ok,
            format!("{other}: destination memory is faulted in 4 KiB pages"),
        ),
    }
}

/// NUMA nodes, for placing channels and accelerators.
pub(crate) fn numa_finding(online: Option<&str>) -> Finding {
    let Some(online) = online.map(str::trim).filter(|text| !text.is_empty()) else {
        return Finding::new("numa", Status::Ok, "no NUMA information (one node assumed)");
    };
    let nodes: u32 = online
        .split(',')
        .filter_map(|range| match range.split_once('-') {
            Some((first, last)) => Some(last.parse::<u32>().ok()? - first.parse::<u32>().ok()? + 1),
            None => range.parse::<u32>().ok().map(|_| 1),
        })
        .sum();
    let detail = format!("{nodes} node(s) online ({online})");
    if nodes > 1 {
        Finding::new("numa", Status::Limited, detail).fix(
            "pin tern (and the VMM) to the node of the NIC and of the DSA devices it uses, \
             e.g. with numactl --cpunodebind",
        )
    } else {
        Finding::new("numa", Status::Ok, detail)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kvm_tells_native_pvm_and_missing_apart() {
        assert_eq!(
            kvm_finding(Ok(()), &["kvm", "kvm_intel"], &[]).status,
            Status::Ok
        );
        let nested = kvm_finding(Ok(()), &["kvm", "kvm_amd"], &["hypervisor"]);
        assert!(nested.detail.contains("nested"), "{}", nested.detail);
        let pvm = kvm_finding(Ok(()), &["kvm", "kvm_pvm"], &["hypervisor"]);
        assert_eq!(pvm.status, Status::Limited);
        assert!(pvm.detail.contains("emulated"), "{}", pvm.detail);
        let missing = kvm_finding(Err("No such file or directory".into()), &[], &[]);
        assert_eq!(missing.status, Status::Missing);
        assert!(missing.fix.is_some());
    }

    #[test]
    fn ktls_needs_the_tls_ulp() {
        assert_eq!(ktls_finding(Some("mptcp tls\n"), false).status, Status::Ok);
        let absent = ktls_finding(Some("mptcp\n"), false);
        assert_eq!(absent.status, Status::Missing);
        assert!(absent.fix.unwrap().contains("CONFIG_TLS"));
        assert!(
            ktls_finding(None, true)
                .fix
                .unwrap()
                .contains("modprobe tls")
        );
    }

    #[test]
    fn memlock_grades_the_limit() {
        assert_eq!(memlock_finding(None, false).status, Status::Ok);
        assert_eq!(memlock_finding(Some(8 << 10), true).status, Status::Ok);
        assert_eq!(
            memlock_finding(Some(8 << 10), false).status,
            Status::Missing
        );
        assert_eq!(
            memlock_finding(Some(8 << 20), false).status,
            Status::Limited
        );
        assert_eq!(memlock_finding(Some(1 << 30), false).status, Status::Ok);
    }

    #[test]
    fn thp_and_numa_are_read_from_their_sysfs_text() {
        let always = thp_finding(Some("[always] madvise never\n"));
        assert_eq!(always.status, Status::Limited);
        assert!(
            thp_finding(Some("always [madvise] never\n"))
                .detail
                .starts_with("madvise")
        );
        assert_eq!(numa_finding(Some("0\n")).status, Status::Ok);
        let two = numa_finding(Some("0-1\n"));
        assert_eq!(two.status, Status::Limited);
        assert!(two.detail.starts_with("2 node"), "{}", two.detail);
        assert!(numa_finding(Some("0,2-3")).detail.starts_with("3 node"));
    }

    #[test]
    fn accelerators_are_found_in_a_fake_sysfs() {
        let root = tempfile::tempdir().unwrap();
        assert_eq!(
            dsa_finding(&root.path().join("absent"), root.path()).status,
            Status::Missing
        );
        let devices = root.path().join("devices");
        for name in ["dsa0", "iax1", "iax3", "wq0.0", "iaxx"] {
            std::fs::create_dir_all(devices.join(name)).unwrap();
        }
        assert_eq!(accelerator_devices(root.path(), "iax"), ["iax1", "iax3"]);
        // Devices without an enabled queue: listed, with the recipe.
        let iaa = iaa_finding(root.path(), root.path());
        assert_eq!(iaa.status, Status::Missing);
        assert!(
            iaa.detail.contains("iax1 (state unknown)"),
            "{}",
            iaa.detail
        );
        assert!(iaa.fix.unwrap().contains("--driver-name=user"));
        let dsa = dsa_finding(root.path(), root.path());
        assert!(dsa.detail.contains("dsa0"), "{}", dsa.detail);
        assert!(
            dsa.fix
                .unwrap()
                .contains("accel-config enable-wq dsa0/wq0.0")
        );
        // SVA off: the refusal names the kernel option.
        std::fs::write(devices.join("dsa0/pasid_enabled"), "0\n").unwrap();
        let wq = devices.join("dsa0/wq0.0");
        std::fs::create_dir_all(&wq).unwrap();
        for (name, value) in [
            ("state", "enabled"),
            ("type", "user"),
            ("mode", "shared"),
            ("size", "128"),
        ] {
            std::fs::write(wq.join(name), value).unwrap();
        }
        let dsa = dsa_finding(root.path(), root.path());
        assert_eq!(dsa.status, Status::Missing);
        assert!(dsa.fix.unwrap().contains("intel_iommu=on,sm_on"));
    }

    /// QPL's default build needs block-on-fault on its IAA queue: a shared,
    /// accessible queue with it off is `limited`, with the accel-config
    /// commands that turn it on; with it on (or unknown) the line is `ok`.
    #[test]
    fn an_iaa_queue_without_block_on_fault_is_named_with_its_fix() {
        let root = tempfile::tempdir().unwrap();
        let device = root.path().join("devices/iax1");
        let wq = device.join("wq1.0");
        std::fs::create_dir_all(&wq).unwrap();
        std::fs::write(device.join("state"), "enabled\n").unwrap();
        for (name, value) in [
            ("state", "enabled"),
            ("type", "user"),
            ("mode", "shared"),
            ("size", "128"),
            ("block_on_fault", "0"),
        ] {
            std::fs::write(wq.join(name), value).unwrap();
        }
        // The queue's node: a regular file this user can read and write.
        std::fs::write(root.path().join("wq1.0"), b"").unwrap();
        let off = iaa_finding(root.path(), root.path());
        assert_eq!(off.status, Status::Limited, "{}", off.detail);
        assert!(off.detail.contains("block-on-fault off"), "{}", off.detail);
        let fix = off.fix.unwrap();
        assert!(
            fix.contains("config-wq iax1/wq1.0 --block-on-fault=1"),
            "{fix}"
        );
        std::fs::write(wq.join("block_on_fault"), "1").unwrap();
        let on = iaa_finding(root.path(), root.path());
        assert_eq!(on.status, Status::Ok, "{}", on.detail);
        assert!(on.fix.is_none());
    }

    #[test]
    fn the_iommu_line_reads_pasid_enabled_and_the_command_line() {
        let on = "BOOT_IMAGE=/vmlinuz intel_iommu=on,sm_on quiet";
        assert!(cmdline_has_scalable_mode(on));
        assert!(!cmdline_has_scalable_mode("intel_iommu=on"));
        let off = iommu_finding(Some("intel_iommu=on"), &[("dsa0".into(), Some(false))]);
        assert_eq!(off.status, Status::Missing);
        assert!(off.fix.unwrap().contains("intel_iommu=on,sm_on"));
        let good = iommu_finding(
            Some(on),
            &[("dsa0".into(), Some(true)), ("iax1".into(), Some(true))],
        );
        assert_eq!(good.status, Status::Ok);
        assert!(good.detail.contains("dsa0, iax1"), "{}", good.detail);
        assert_eq!(iommu_finding(None, &[]).status, Status::Missing);
        assert_eq!(iommu_finding(Some(on), &[]).status, Status::Ok);
    }

    #[test]
    fn rawio_accel_config_and_the_qpl_probe_say_what_to_do() {
        assert_eq!(rawio_finding(true).status, Status::Ok);
        let without = rawio_finding(false);
        assert!(
            without.detail.contains("INTEL-SA-01084"),
            "{}",
            without.detail
        );
        assert!(without.fix.unwrap().contains("cap_sys_rawio"));
        assert!(accel_config_finding(false).fix.is_some());
        assert_eq!(qpl_hardware_finding(Ok(())).status, Status::Ok);
        assert!(qpl_hardware_finding(Err("no IAA".into())).fix.is_some());
    }

    #[test]
    fn the_json_names_are_stable() {
        let finding = Finding::new("qpl", Status::Missing, "absent").fix("install it");
        let json = serde_json::to_value(&finding).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"topic": "qpl", "status": "missing", "detail": "absent", "fix": "install it"})
        );
    }
}
