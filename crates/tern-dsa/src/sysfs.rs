//! Finding DSA work queues: the idxd driver publishes devices and their work
//! queues under `/sys/bus/dsa/devices`, and user work queues as character
//! devices `/dev/dsa/wqD.Q`.
//!
//! The root is a parameter so tests can run on a fake tree in a temporary
//! directory. Real sysfs lists work queues both flat (`devices/wq0.0`) and as
//! children of their device (`devices/dsa0/wq0.0`); both shapes are accepted
//! and de-duplicated.

use std::fs;
use std::path::{Path, PathBuf};

use crate::DsaError;

/// How a work queue accepts descriptors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WqMode {
    /// One submitter (PASID fixed on the queue); MOVDIR64B, posted writes,
    /// no acceptance feedback: software must not overfill it.
    Dedicated,
    /// Many submitters; ENQCMD, which reports whether the queue accepted.
    Shared,
}

impl WqMode {
    /// The sysfs spelling.
    pub fn name(self) -> &'static str {
        match self {
            WqMode::Dedicated => "dedicated",
            WqMode::Shared => "shared",
        }
    }
}

/// A usable (enabled, user-type) work queue found in sysfs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkQueueInfo {
    /// DSA or IAA.
    pub kind: AccelKind,
    /// Device name, e.g. `dsa0` or `iax1`.
    pub device: String,
    /// Queue name as in sysfs and /dev, e.g. `wq0.0`.
    pub queue: String,
    /// The `name` attribute given with accel-config (may be empty).
    pub label: String,
    /// Dedicated or shared.
    pub mode: WqMode,
    /// Queue depth in descriptors (`size`).
    pub size: u32,
    /// Largest batch the queue accepts (`max_batch_size`).
    pub max_batch_size: u32,
    /// Whether a page fault stalls the queue until the kernel resolves it
    /// (`block_on_fault`; `None` when sysfs does not say). tern's DSA queue
    /// wants it off (a fault ends the descriptor and the CPU takes the
    /// page); QPL's default build wants it on for every IAA queue.
    pub block_on_fault: Option<bool>,
    /// Character device to open, e.g. `/dev/dsa/wq0.0`.
    pub dev_path: PathBuf,
    /// The queue's sysfs directory (its `state` says whether it is still
    /// enabled).
    pub sysfs_dir: PathBuf,
    /// NUMA node of the device, when sysfs says (`-1` is reported as None).
    pub numa_node: Option<u32>,
}

impl WorkQueueInfo {
    /// `dsa0/wq0.0`, the name accel-config uses.
    pub fn full_name(&self) -> String {
        format!("{}/{}", self.device, self.queue)
    }
}

/// Reads one trimmed attribute; `None` if absent or unreadable.
fn attr(dir: &Path, name: &str) -> Option<String> {
    fs::read_to_string(dir.join(name))
        .ok()
        .map(|s| s.trim().to_owned())
}

/// Splits `wqD.Q` into `(D, Q)`.
fn parse_wq_name(name: &str) -> Option<(u32, u32)> {
    let rest = name.strip_prefix("wq")?;
    let (d, q) = rest.split_once('.')?;
    Some((d.parse().ok()?, q.parse().ok()?))
}

/// Which accelerator a device under `/sys/bus/dsa` is: the idxd driver
/// serves both DSA (`dsaN`) and IAA (`iaxN`, In-Memory Analytics
/// Accelerator) and numbers them from one id space, so `wqN.M` belongs to
/// whichever of `dsaN` / `iaxN` exists.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AccelKind {
    /// Data Streaming Accelerator: zero-page checks (COMPVAL).
    Dsa,
    /// In-Memory Analytics Accelerator: (de)compression, for the QPL path.
    Iaa,
}

impl AccelKind {
    /// The device-name prefix in sysfs: `dsa` or `iax`.
    pub fn prefix(self) -> &'static str {
        match self {
            AccelKind::Dsa => "dsa",
            AccelKind::Iaa => "iax",
        }
    }

    /// The usual device-node directory: `/dev/dsa` or `/dev/iax`.
    pub fn default_dev_root(self) -> &'static str {
        match self {
            AccelKind::Dsa => "/dev/dsa",
            AccelKind::Iaa => "/dev/iax",
        }
    }
}

/// Lists the usable DSA work queues under `sysfs_root` (normally
/// `/sys/bus/dsa`), with device nodes under `dev_root` (normally `/dev/dsa`).
/// IAA queues on the same bus are skipped (see [`discover_iaa_work_queues`]).
///
/// A queue is usable when it and its device are `enabled` and its `type` is
/// `user` (kernel queues belong to the dmaengine driver). Disabled or kernel
/// queues are skipped silently: they are someone else's configuration, not an
/// error. The result is sorted by device then queue, so round-robin order is
/// stable between runs.
///
/// # Errors
///
/// [`DsaError::NoWorkQueue`] if the tree is missing or holds no usable
/// queue, with a hint on how to configure one.
pub fn discover_work_queues(
    sysfs_root: &Path,
    dev_root: &Path,
) -> Result<Vec<WorkQueueInfo>, DsaError> {
    let found = discover_queues(sysfs_root, AccelKind::Dsa, dev_root);
    if found.is_empty() {
        let devices = devices_without_sva(sysfs_root, AccelKind::Dsa);
        if !devices.is_empty() {
            return Err(DsaError::NoSva {
                devices: devices.join(", "),
            });
        }
        return Err(DsaError::NoWorkQueue {
            root: sysfs_root.display().to_string(),
        });
    }
    Ok(found)
}

/// Lists the usable IAA work queues under `sysfs_root` (normally
/// `/sys/bus/dsa`, where the idxd driver lists IAA devices as `iaxN`), with
/// device nodes under `dev_root` (normally `/dev/iax`), for the QPL hardware
/// path. Same rules as [`discover_work_queues`].
///
/// # Errors
///
/// [`DsaError::NoIaaQueue`] if the tree is missing or holds no usable
/// IAA queue.
pub fn discover_iaa_work_queues(
    sysfs_root: &Path,
    dev_root: &Path,
) -> Result<Vec<WorkQueueInfo>, DsaError> {
    let found = discover_queues(sysfs_root, AccelKind::Iaa, dev_root);
    if found.is_empty() {
        let devices = devices_without_sva(sysfs_root, AccelKind::Iaa);
        if !devices.is_empty() {
            return Err(DsaError::NoSva {
                devices: devices.join(", "),
            });
        }
        return Err(DsaError::NoIaaQueue {
            root: sysfs_root.display().to_string(),
        });
    }
    Ok(found)
}

/// Whether the device in `device_dir` says user PASID (shared virtual
/// addressing) is off: its `pasid_enabled` attribute reads `0`. Without SVA
/// the device would take tern's virtual addresses as physical ones, so its
/// user queues are never used. Kernels without the attribute predate the
/// check and are trusted (they refuse user queues without SVA themselves).
pub fn sva_disabled(device_dir: &Path) -> bool {
    attr(device_dir, "pasid_enabled").is_some_and(|v| v == "0")
}

/// The devices of `kind` whose `pasid_enabled` reads 0, sorted.
pub fn devices_without_sva(sysfs_root: &Path, kind: AccelKind) -> Vec<String> {
    let Ok(entries) = fs::read_dir(sysfs_root.join("devices")) else {
        return Vec::new();
    };
    let mut names: Vec<String> = entries
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| {
            n.strip_prefix(kind.prefix())
                .is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
        })
        .filter(|n| sva_disabled(&sysfs_root.join("devices").join(n)))
        .collect();
    names.sort();
    names
}

/// The kind of device `N` of `wqN.M`: `iaxN` if that device exists, else
/// DSA (also when neither exists, as in trees that list queues only).
fn kind_of_device(devices: &Path, index: u32) -> AccelKind {
    if devices.join(format!("iax{index}")).exists() {
        AccelKind::Iaa
    } else {
        AccelKind::Dsa
    }
}

/// The usable queues of one kind, sorted by device then queue; empty when
/// the tree is missing.
pub fn discover_queues(sysfs_root: &Path, kind: AccelKind, dev_root: &Path) -> Vec<WorkQueueInfo> {
    let devices = sysfs_root.join("devices");
    let Ok(entries) = fs::read_dir(&devices) else {
        return Vec::new();
    };
    // (queue directory, kind of its device)
    let mut candidates: Vec<(PathBuf, AccelKind)> = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = entry.path();
        if let Some((d, _)) = parse_wq_name(&name) {
            candidates.push((path, kind_of_device(&devices, d)));
            continue;
        }
        let parent_kind = if name.starts_with("dsa") {
            AccelKind::Dsa
        } else if name.starts_with("iax") {
            AccelKind::Iaa
        } else {
            continue;
        };
        if let Ok(children) = fs::read_dir(&path) {
            candidates.extend(
                children
                    .flatten()
                    .filter(|c| parse_wq_name(&c.file_name().to_string_lossy()).is_some())
                    .map(|c| (c.path(), parent_kind)),
            );
        }
    }
    let mut found: Vec<(u32, u32, WorkQueueInfo)> = Vec::new();
    for (dir, queue_kind) in candidates {
        if queue_kind != kind {
            continue;
        }
        let queue = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let Some((d, q)) = parse_wq_name(&queue) else {
            continue;
        };
        if found.iter().any(|(fd, fq, _)| (*fd, *fq) == (d, q)) {
            continue;
        }
        if let Some(info) = read_queue(&devices, &dir, kind, d, &queue, dev_root) {
            found.push((d, q, info));
        }
    }
    found.sort_by_key(|(d, q, _)| (*d, *q));
    found.into_iter().map(|(_, _, i)| i).collect()
}

/// Reads one queue directory; `None` if it is not usable by user space.
fn read_queue(
    devices: &Path,
    dir: &Path,
    kind: AccelKind,
    dev_index: u32,
    queue: &str,
    dev_root: &Path,
) -> Option<WorkQueueInfo> {
    let device = format!("{}{dev_index}", kind.prefix());
    let device_dir = devices.join(&device);
    if attr(dir, "state")? != "enabled" {
        return None;
    }
    // Older kernels and fake trees may lack the device's state file; the
    // queue cannot be enabled without its device, so only an explicit
    // non-enabled state disqualifies it.
    if attr(&device_dir, "state").is_some_and(|s| s != "enabled") {
        return None;
    }
    if attr(dir, "type")? != "user" || sva_disabled(&device_dir) {
        return None;
    }
    let mode = match attr(dir, "mode")?.as_str() {
        "dedicated" => WqMode::Dedicated,
        "shared" => WqMode::Shared,
        _ => return None,
    };
    let size: u32 = attr(dir, "size")?.parse().ok()?;
    if size == 0 {
        return None;
    }
    let max_batch_size = attr(dir, "max_batch_size")
        .or_else(|| attr(&device_dir, "max_batch_size"))
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let numa_node = attr(&device_dir, "numa_node").and_then(|s| s.parse::<u32>().ok());
    let block_on_fault = attr(dir, "block_on_fault").and_then(|s| match s.as_str() {
        "1" => Some(true),
        "0" => Some(false),
        _ => None,
    });
    Some(WorkQueueInfo {
        kind,
        device,
        queue: queue.to_owned(),
        label: attr(dir, "name").unwrap_or_default(),
        mode,
        size,
        max_batch_size,
        block_on_fault,
        dev_path: dev_root.join(queue),
        sysfs_dir: dir.to_path_buf(),
        numa_node,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use std::fs;
    use std::path::Path;

    use super::{
        AccelKind, WorkQueueInfo, WqMode, discover_iaa_work_queues, discover_work_queues,
        parse_wq_name,
    };
    use crate::DsaError;

    /// Writes a fake work queue directory.
    #[allow(clippy::too_many_arguments)] // a test fixture, read at call sites
    pub(crate) fn fake_wq(
        root: &Path,
        nested: bool,
        dev: u32,
        q: u32,
        state: &str,
        kind: &str,
        mode: &str,
        batch: u32,
    ) {
        let devdir = root.join("devices").join(format!("dsa{dev}"));
        fs::create_dir_all(&devdir).unwrap();
        fs::write(devdir.join("state"), "enabled\n").unwrap();
        fs::write(devdir.join("numa_node"), "-1\n").unwrap();
        let wq = if nested {
            devdir.join(format!("wq{dev}.{q}"))
        } else {
            root.join("devices").join(format!("wq{dev}.{q}"))
        };
        fs::create_dir_all(&wq).unwrap();
        for (k, v) in [
            ("state", state),
            ("type", kind),
            ("mode", mode),
            ("size", "16"),
            ("name", "tern"),
        ] {
            fs::write(wq.join(k), format!("{v}\n")).unwrap();
        }
        fs::write(wq.join("max_batch_size"), format!("{batch}\n")).unwrap();
    }

    #[test]
    fn finds_dedicated_and_shared_skips_disabled_and_kernel() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path();
        fake_wq(root, true, 0, 0, "enabled", "user", "dedicated", 32);
        fake_wq(root, false, 1, 0, "enabled", "user", "shared", 1024);
        fake_wq(root, true, 0, 1, "disabled", "user", "dedicated", 32);
        fake_wq(root, true, 1, 1, "enabled", "kernel", "dedicated", 32);
        let wqs = discover_work_queues(root, Path::new("/dev/dsa")).unwrap();
        assert_eq!(wqs.len(), 2, "{wqs:?}");
        assert_eq!(wqs[0].full_name(), "dsa0/wq0.0");
        assert_eq!(wqs[0].mode, WqMode::Dedicated);
        assert_eq!(wqs[0].max_batch_size, 32);
        assert_eq!(wqs[0].size, 16);
        assert_eq!(wqs[0].label, "tern");
        assert_eq!(wqs[0].numa_node, None);
        assert_eq!(wqs[0].dev_path, Path::new("/dev/dsa/wq0.0"));
        assert_eq!(wqs[1].full_name(), "dsa1/wq1.0");
        assert_eq!(wqs[1].mode, WqMode::Shared);
        assert_eq!(wqs[1].max_batch_size, 1024);
    }

    #[test]
    fn flat_and_nested_listing_is_deduplicated() {
        let t = tempfile::tempdir().unwrap();
        fake_wq(t.path(), true, 2, 3, "enabled", "user", "shared", 8);
        fake_wq(t.path(), false, 2, 3, "enabled", "user", "shared", 8);
        let wqs = discover_work_queues(t.path(), Path::new("/d")).unwrap();
        assert_eq!(wqs.len(), 1);
    }

    #[test]
    fn disabled_device_hides_its_queues() {
        let t = tempfile::tempdir().unwrap();
        fake_wq(t.path(), true, 0, 0, "enabled", "user", "dedicated", 32);
        fs::write(t.path().join("devices/dsa0/state"), "disabled\n").unwrap();
        assert!(discover_work_queues(t.path(), Path::new("/d")).is_err());
    }

    #[test]
    fn missing_or_empty_tree_is_a_clear_error() {
        let t = tempfile::tempdir().unwrap();
        let missing = t.path().join("nope");
        let err = discover_work_queues(&missing, Path::new("/d")).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("no DSA work queue found"), "{msg}");
        assert!(msg.contains("accel-config"), "{msg}");
        fake_wq(t.path(), true, 0, 0, "disabled", "user", "dedicated", 32);
        assert!(matches!(
            discover_work_queues(t.path(), Path::new("/d")),
            Err(DsaError::NoWorkQueue { .. })
        ));
    }

    /// Writes a fake IAA queue `iax{dev}/wq{dev}.{q}` (nested) or flat.
    fn fake_iaa_wq(root: &Path, nested: bool, dev: u32, q: u32) {
        fake_wq(root, nested, dev, q, "enabled", "user", "shared", 64);
        let dsa = root.join("devices").join(format!("dsa{dev}"));
        let iax = root.join("devices").join(format!("iax{dev}"));
        fs::rename(&dsa, &iax).unwrap();
    }

    #[test]
    fn iaa_queues_are_not_dsa_queues() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path();
        fake_wq(root, true, 0, 0, "enabled", "user", "dedicated", 32);
        fake_iaa_wq(root, true, 1, 0);
        // Flat listing of an IAA queue: wq3.0 next to devices/iax3.
        fake_iaa_wq(root, false, 3, 0);
        let dsa = discover_work_queues(root, Path::new("/dev/dsa")).unwrap();
        assert_eq!(dsa.len(), 1, "{dsa:?}");
        assert_eq!(dsa[0].full_name(), "dsa0/wq0.0");
        assert_eq!(dsa[0].kind, AccelKind::Dsa);
        let iaa = discover_iaa_work_queues(root, Path::new("/dev/iax")).unwrap();
        let names: Vec<String> = iaa.iter().map(WorkQueueInfo::full_name).collect();
        assert_eq!(names, ["iax1/wq1.0", "iax3/wq3.0"]);
        assert!(iaa.iter().all(|w| w.kind == AccelKind::Iaa));
        assert_eq!(iaa[0].dev_path, Path::new("/dev/iax/wq1.0"));
        assert_eq!(iaa[0].max_batch_size, 64);
        // Only IAA queues: no DSA queue, and the error says so.
        let t = tempfile::tempdir().unwrap();
        fake_iaa_wq(t.path(), true, 0, 0);
        assert!(matches!(
            discover_work_queues(t.path(), Path::new("/d")),
            Err(DsaError::NoWorkQueue { .. })
        ));
        let empty = tempfile::tempdir().unwrap();
        let err = discover_iaa_work_queues(empty.path(), Path::new("/d")).unwrap_err();
        assert!(err.to_string().contains("no IAA work queue"), "{err}");
    }

    #[test]
    fn a_device_without_sva_is_refused_naming_the_kernel_option() {
        let t = tempfile::tempdir().unwrap();
        fake_wq(t.path(), true, 0, 0, "enabled", "user", "dedicated", 32);
        fs::write(t.path().join("devices/dsa0/pasid_enabled"), "0\n").unwrap();
        let err = discover_work_queues(t.path(), Path::new("/d")).unwrap_err();
        assert!(matches!(err, DsaError::NoSva { .. }), "{err:?}");
        let msg = err.to_string();
        assert!(
            msg.contains("intel_iommu=on,sm_on") && msg.contains("dsa0"),
            "{msg}"
        );
        fs::write(t.path().join("devices/dsa0/pasid_enabled"), "1\n").unwrap();
        assert_eq!(
            discover_work_queues(t.path(), Path::new("/d"))
                .unwrap()
                .len(),
            1
        );
    }

    #[test]
    fn wq_names() {
        assert_eq!(parse_wq_name("wq0.0"), Some((0, 0)));
        assert_eq!(parse_wq_name("wq12.7"), Some((12, 7)));
        assert_eq!(parse_wq_name("wq1"), None);
        assert_eq!(parse_wq_name("engine0.0"), None);
    }
}
