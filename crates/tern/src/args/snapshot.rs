//! The syntax of the snapshot commands: `tern save`, `tern vm save`,
//! `tern restore`, `tern vm restore` and `tern serve-pages`.

use std::path::PathBuf;

use clap::Args;
use tern_engine::snapshot::SaveConfig;

use super::GuestArgs;
use super::vm::VmArgs;

/// How to write the file (both guests).
#[derive(Debug, Args, Clone)]
pub(crate) struct SaveFileArgs {
    /// The snapshot file to write (replaced if it exists).
    #[arg(long, short)]
    pub output: PathBuf,
    /// Save while the guest runs (precopy into the file, the guest paused
    /// only for the last pass); default: pause, then write.
    #[arg(long)]
    pub live: bool,
    /// Writer threads [default: the cores this process may run on, at most 4].
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub writers: Option<u16>,
    /// Write pages with O_DIRECT, bypassing the page cache.
    #[arg(long)]
    pub direct: bool,
    /// Save a diff on this snapshot (full or itself a diff): only the
    /// chunks whose content differs from it are written, and the file
    /// names it by its memory digest. Restore with --base.
    #[arg(long, value_name = "FILE")]
    pub diff_base: Option<PathBuf>,
    /// Keep the guest's dirty log running after the save, so the diffs
    /// of --diff-output hold exactly the pages written since, not whole
    /// chunks. Firecracker: `track_dirty_pages`. QEMU: no equivalent.
    #[arg(long)]
    pub track_dirty_pages: bool,
    /// After the save, save a diff into FILE, each on the file saved
    /// before it (repeat for a chain): from the dirty log with
    /// --track-dirty-pages, else by content. Restore with --base.
    /// Firecracker: `snapshot_type: Diff`.
    #[arg(long, value_name = "FILE")]
    pub diff_output: Vec<PathBuf>,
    /// How long the guest runs before each --diff-output, in milliseconds.
    #[arg(long, default_value_t = 500, requires = "diff_output")]
    pub diff_after: u64,
    /// Do not wait for the file to reach the disk (as QEMU's migration to
    /// a file): faster, but a crash soon after may lose the snapshot (a
    /// file torn that way is refused at restore, never restored).
    #[arg(long)]
    pub no_sync: bool,
    /// Leave the guest paused after the save (it is discarded on exit).
    #[arg(long)]
    pub stop: bool,
    /// How long the guest runs before the save starts, in milliseconds.
    #[arg(long, default_value_t = 200)]
    pub warmup: u64,
    /// Print one JSON document instead of the summary.
    #[arg(long)]
    pub json: bool,
}

impl SaveFileArgs {
    /// The engine's settings for the save.
    pub(crate) fn config(&self) -> SaveConfig {
        {
            let mut config = SaveConfig::default();
            if let Some(writers) = self.writers {
                config.writers = usize::from(writers);
            }
            config.direct = self.direct;
            config.live = self.live;
            config.resume = !self.stop;
            config.sync = !self.no_sync;
            config.diff_base = self.diff_base.clone();
            config
        }
    }
}

#[derive(Debug, Args)]
pub(crate) struct SaveArgs {
    #[command(flatten)]
    pub guest: GuestArgs,
    #[command(flatten)]
    pub file: SaveFileArgs,
    /// Before each --diff-output, pause the guest and write this percent
    /// of its pages, spread evenly across memory (a known set to diff:
    /// tests and benchmarks).
    #[arg(long, value_name = "PERCENT", requires = "diff_output",
          value_parser = clap::value_parser!(u8).range(1..=100))]
    pub diff_dirty_spread: Option<u8>,
}

#[derive(Debug, Args)]
pub(crate) struct VmSaveArgs {
    #[command(flatten)]
    pub vm: VmArgs,
    #[command(flatten)]
    pub file: SaveFileArgs,
}

#[derive(Debug, Args)]
pub(crate) struct RestoreArgs {
    /// The snapshot file.
    #[arg(long, short)]
    pub snapshot: PathBuf,
    /// The snapshot is a diff: the files under it, oldest first (the full
    /// snapshot, then any diffs between it and --snapshot), once each.
    #[arg(long, value_name = "FILE")]
    pub base: Vec<PathBuf>,
    /// Resume the guest at once and fault its memory in from the file
    /// (userfaultfd), prefetching the working set, then the rest.
    #[arg(long)]
    pub lazy: bool,
    /// Reader threads (eager) or background loaders (lazy).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub threads: u16,
    /// Lazy: prefetch this working set (from --record-working-set of an
    /// earlier restore) instead of the one saved in the file.
    #[arg(long)]
    pub working_set: Option<PathBuf>,
    /// Lazy: no prefetch of a working set, only the rest in order.
    #[arg(long)]
    pub no_prefetch: bool,
    /// Lazy: write the pages the guest faulted on, in order, to this file
    /// (a working set for the next --working-set).
    #[arg(long)]
    pub record_working_set: Option<PathBuf>,
    /// Right after the resume, read SIZE of guest memory spread across
    /// all of it (runs of one 64 KiB chunk, evenly spaced), as a guest
    /// touching a working set would, and report how long that took: the
    /// time to fault in a working set that the in-order loader does not
    /// reach first (Firecracker CI's case; for --working-set benchmarks).
    #[arg(long, value_name = "SIZE", value_parser = crate::units::parse_size)]
    pub touch_spread: Option<u64>,
    /// How long the restored guest runs before the report, in milliseconds.
    #[arg(long, default_value_t = 500)]
    pub run_after: u64,
    /// Lazy: start the background loaders only this many milliseconds
    /// after the resume (and after --touch-spread); until then only the
    /// guest's faults bring pages in, so --record-working-set records
    /// everything the guest touched in that time (REAP's recording run).
    #[arg(long, value_name = "MS", requires = "lazy")]
    pub load_after: Option<u64>,
    /// Lazy: how long memory may take to load fully, in seconds.
    #[arg(long, default_value_t = 300)]
    pub load_timeout: u64,
    /// Print one JSON document instead of the summary.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub(crate) struct MergeSnapshotArgs {
    /// The diff snapshot.
    #[arg(long, short)]
    pub(crate) snapshot: PathBuf,
    /// The files under it, oldest first, as for `tern restore --base`.
    #[arg(long, value_name = "FILE", required = true)]
    pub(crate) base: Vec<PathBuf>,
    /// The full snapshot to write (replaced if it exists; never an input).
    #[arg(long, short)]
    pub(crate) output: PathBuf,
    /// Print one JSON document instead of the summary.
    #[arg(long)]
    pub(crate) json: bool,
}

#[derive(Debug, Args)]
pub(crate) struct ServePagesArgs {
    /// The Unix socket to listen on (the path given to Firecracker's
    /// snapshot load as the UFFD backend); it must not exist yet.
    #[arg(long)]
    pub socket: PathBuf,
    /// Serve this tern snapshot (its regions must be the VMM's, in order).
    #[arg(
        long,
        required_unless_present = "memory_file",
        conflicts_with = "memory_file"
    )]
    pub snapshot: Option<PathBuf>,
    /// The snapshot is a diff: the files under it, oldest first, as for
    /// `tern restore --base`.
    #[arg(long, value_name = "FILE", requires = "snapshot")]
    pub base: Vec<PathBuf>,
    /// Serve this raw memory file (Firecracker's snapshot memory file).
    #[arg(long)]
    pub memory_file: Option<PathBuf>,
    /// How long to wait for the VMM to connect and send its handshake, in
    /// seconds.
    #[arg(long, default_value_t = 60)]
    pub accept_timeout: u64,
    /// Background loader threads (0: serve faults only).
    #[arg(long, default_value_t = 1)]
    pub loaders: u16,
    /// Do not prefetch the snapshot's recorded working set first.
    #[arg(long)]
    pub no_prefetch: bool,
    /// Print one JSON document at the end instead of the summary.
    #[arg(long)]
    pub json: bool,
}
