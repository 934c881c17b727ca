//! Which DSA devices and work queues to use: the user's list
//! (`--dsa-device dsa0,dsa2/wq2.1`), the NUMA preference, and the node of
//! the CPU a thread runs on.

use std::fmt;
use std::str::FromStr;

use crate::sysfs::WorkQueueInfo;

/// One entry of a device list.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Entry {
    /// Every queue of a device: `dsa0`.
    Device(String),
    /// One queue: `dsa2/wq2.1`, or `wq2.1` (queue names are unique on a
    /// host, the device is implied by the number).
    Queue {
        device: Option<String>,
        queue: String,
    },
}

/// A list of DSA devices and/or work queues to use; empty = every usable
/// queue.
///
/// Parsed from a comma-separated list such as `dsa0,dsa2/wq2.1,wq4.0`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct DsaSelection {
    entries: Vec<Entry>,
}

/// Why a device list could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "'{entry}' is not a DSA device or work queue (use names as accel-config lists them: \
     dsa0, dsa2/wq2.1 or wq2.1, separated by commas)"
)]
pub struct BadSelection {
    /// The entry that did not parse.
    pub entry: String,
}

/// `dsaN` → true.
fn is_device_name(s: &str) -> bool {
    s.strip_prefix("dsa")
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// `wqN.M` → true.
fn is_queue_name(s: &str) -> bool {
    s.strip_prefix("wq")
        .and_then(|r| r.split_once('.'))
        .is_some_and(|(d, q)| {
            !d.is_empty()
                && !q.is_empty()
                && d.bytes().all(|b| b.is_ascii_digit())
                && q.bytes().all(|b| b.is_ascii_digit())
        })
}

impl DsaSelection {
    /// Every usable queue.
    pub fn all() -> Self {
        Self::default()
    }

    /// Whether this selects every queue (no list given).
    pub fn is_all(&self) -> bool {
        self.entries.is_empty()
    }

    /// Whether the list names `wq`, directly or through its device.
    pub fn matches(&self, wq: &WorkQueueInfo) -> bool {
        self.is_all()
            || self.entries.iter().any(|e| match e {
                Entry::Device(d) => *d == wq.device,
                Entry::Queue { device, queue } => {
                    *queue == wq.queue && device.as_ref().is_none_or(|d| *d == wq.device)
                }
            })
    }
}

impl FromStr for DsaSelection {
    type Err = BadSelection;

    fn from_str(text: &str) -> Result<Self, BadSelection> {
        let mut entries = Vec::new();
        for raw in text.split(',') {
            let item = raw.trim();
            let bad = || BadSelection {
                entry: item.to_owned(),
            };
            let entry = match item.split_once('/') {
                Some((d, q)) if is_device_name(d) && is_queue_name(q) => Entry::Queue {
                    device: Some(d.to_owned()),
                    queue: q.to_owned(),
                },
                Some(_) => return Err(bad()),
                None if is_device_name(item) => Entry::Device(item.to_owned()),
                None if is_queue_name(item) => Entry::Queue {
                    device: None,
                    queue: item.to_owned(),
                },
                None => return Err(bad()),
            };
            if !entries.contains(&entry) {
                entries.push(entry);
            }
        }
        Ok(DsaSelection { entries })
    }
}

impl fmt::Display for DsaSelection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.entries.is_empty() {
            return f.write_str("all");
        }
        for (i, e) in self.entries.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            match e {
                Entry::Device(d) => f.write_str(d)?,
                Entry::Queue {
                    device: Some(d),
                    queue,
                } => write!(f, "{d}/{queue}")?,
                Entry::Queue {
                    device: None,
                    queue,
                } => f.write_str(queue)?,
            }
        }
        Ok(())
    }
}

/// What `--dsa-device` names: the hardware (all queues or a list), or the
/// software device.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub enum DsaDevice {
    /// Hardware work queues found in sysfs, limited to the selection.
    #[default]
    Hardware,
    /// Only these hardware devices or queues.
    Only(DsaSelection),
    /// tern's software device (a CPU thread running the descriptors).
    Software,
}

impl FromStr for DsaDevice {
    type Err = BadSelection;

    fn from_str(text: &str) -> Result<Self, BadSelection> {
        match text.trim() {
            "hw" | "hardware" => Ok(DsaDevice::Hardware),
            "software" | "soft" => Ok(DsaDevice::Software),
            list => list.parse().map(DsaDevice::Only),
        }
    }
}

impl fmt::Display for DsaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DsaDevice::Hardware => f.write_str("hw"),
            DsaDevice::Only(selection) => selection.fmt(f),
            DsaDevice::Software => f.write_str("software"),
        }
    }
}

/// Which devices a submission may use, by NUMA node.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum NumaPolicy {
    /// Devices on the submitting CPU's node first; the others only when
    /// every local queue is full or disabled (or there is none).
    #[default]
    PreferLocal,
    /// Every device alike, round-robin.
    Any,
}

/// Whether a queue on `queue_node` is local to a CPU on `cpu_node`. Unknown
/// on either side counts as local: single-node machines report `-1`.
pub fn is_local(queue_node: Option<u32>, cpu_node: Option<u32>) -> bool {
    match (queue_node, cpu_node) {
        (Some(q), Some(c)) => q == c,
        _ => true,
    }
}

/// The NUMA node of the CPU the calling thread runs on now, `None` if the
/// kernel does not say.
pub fn current_numa_node() -> Option<u32> {
    let mut cpu: libc::c_uint = 0;
    let mut node: libc::c_uint = 0;
    // SAFETY: getcpu writes two unsigned ints through valid pointers; the
    // third (cache) argument is unused since Linux 2.6.24 and may be NULL.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_getcpu,
            &mut cpu as *mut libc::c_uint,
            &mut node as *mut libc::c_uint,
            std::ptr::null_mut::<libc::c_void>(),
        )
    };
    (rc == 0).then_some(node)
}

#[cfg(test)]
mod tests {
    use super::{DsaDevice, DsaSelection, current_numa_node, is_local};
    use crate::sysfs::{AccelKind, WorkQueueInfo, WqMode};

    fn wq(device: &str, queue: &str) -> WorkQueueInfo {
        WorkQueueInfo {
            kind: AccelKind::Dsa,
            device: device.into(),
            queue: queue.into(),
            label: String::new(),
            mode: WqMode::Shared,
            size: 32,
            max_batch_size: 32,
            block_on_fault: None,
            dev_path: format!("/dev/dsa/{queue}").into(),
            sysfs_dir: format!("/sys/bus/dsa/devices/{queue}").into(),
            numa_node: None,
        }
    }

    #[test]
    fn lists_of_devices_and_queues() {
        let s: DsaSelection = "dsa0, dsa2/wq2.1,wq4.0".parse().unwrap();
        assert_eq!(s.to_string(), "dsa0,dsa2/wq2.1,wq4.0");
        assert!(s.matches(&wq("dsa0", "wq0.0")) && s.matches(&wq("dsa0", "wq0.3")));
        assert!(s.matches(&wq("dsa2", "wq2.1")));
        assert!(!s.matches(&wq("dsa2", "wq2.0")));
        assert!(s.matches(&wq("dsa4", "wq4.0")));
        assert!(!s.matches(&wq("dsa1", "wq1.0")));
        assert!(DsaSelection::all().matches(&wq("dsa7", "wq7.7")));
        assert_eq!(DsaSelection::all().to_string(), "all");
        for bad in [
            "",
            "dsa",
            "iax1",
            "dsa0/",
            "dsa0/wq0",
            "wq0.x",
            "dsa0,,dsa1",
        ] {
            let err = bad.parse::<DsaSelection>().unwrap_err();
            assert!(err.to_string().contains("accel-config"), "{bad}: {err}");
        }
    }

    #[test]
    fn dsa_device_values() {
        assert_eq!("hw".parse(), Ok(DsaDevice::Hardware));
        assert_eq!("software".parse(), Ok(DsaDevice::Software));
        let only: DsaDevice = "dsa0,dsa2/wq2.1".parse().unwrap();
        assert_eq!(only.to_string(), "dsa0,dsa2/wq2.1");
        assert!(matches!(only, DsaDevice::Only(_)));
        assert!("gpu".parse::<DsaDevice>().is_err());
    }

    #[test]
    fn locality() {
        assert!(is_local(Some(1), Some(1)));
        assert!(!is_local(Some(0), Some(1)));
        assert!(is_local(None, Some(1)) && is_local(Some(0), None));
        // Only checks it answers on Linux.
        assert!(current_numa_node().is_some());
    }
}
