//! Helpers for tests that run the `tern` binary as separate processes.
#![allow(dead_code)]

use std::ffi::OsStr;
use std::ops::{Deref, DerefMut};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::mpsc;

use tern_test_skip::wait::{DEADLINE, exit_within, output_within};

/// The `tern` binary built for these tests.
pub(crate) fn tern() -> Tern {
    Tern {
        command: Command::new(env!("CARGO_BIN_EXE_tern")),
        line: "tern".to_string(),
        stdin: false,
        stdout: false,
        stderr: false,
    }
}

/// A `tern` command line whose [`Tern::output`] and [`Tern::status`] wait
/// at most [`DEADLINE`] (docs/testing.md, "Fail, don't hang"): a `tern`
/// that hangs is killed and the test fails naming the command line. The
/// builder methods are [`Command`]'s; there is deliberately no `Deref` to
/// it, whose `output` would wait without a bound.
pub(crate) struct Tern {
    command: Command,
    /// The command line, for the failure message.
    line: String,
    /// Whether the test chose the standard streams itself.
    stdin: bool,
    stdout: bool,
    stderr: bool,
}

impl Tern {
    pub(crate) fn arg(&mut self, arg: impl AsRef<OsStr>) -> &mut Self {
        self.line.push(' ');
        self.line.push_str(&arg.as_ref().to_string_lossy());
        self.command.arg(arg);
        self
    }

    pub(crate) fn args<I: IntoIterator<Item = S>, S: AsRef<OsStr>>(
        &mut self,
        args: I,
    ) -> &mut Self {
        for arg in args {
            self.arg(arg);
        }
        self
    }

    pub(crate) fn env(&mut self, key: impl AsRef<OsStr>, value: impl AsRef<OsStr>) -> &mut Self {
        self.command.env(key, value);
        self
    }

    pub(crate) fn env_remove(&mut self, key: impl AsRef<OsStr>) -> &mut Self {
        self.command.env_remove(key);
        self
    }

    pub(crate) fn stdin(&mut self, stdin: impl Into<Stdio>) -> &mut Self {
        self.stdin = true;
        self.command.stdin(stdin);
        self
    }

    pub(crate) fn stdout(&mut self, stdout: impl Into<Stdio>) -> &mut Self {
        self.stdout = true;
        self.command.stdout(stdout);
        self
    }

    pub(crate) fn stderr(&mut self, stderr: impl Into<Stdio>) -> &mut Self {
        self.stderr = true;
        self.command.stderr(stderr);
        self
    }

    /// [`Command::spawn`]: the test bounds its waits on the child (wrap
    /// it in [`Reaped`], whose waits are bounded).
    pub(crate) fn spawn(&mut self) -> std::io::Result<Child> {
        self.command.spawn()
    }

    /// [`Command::output`] (standard input empty, output and error
    /// captured unless the test chose otherwise), waiting at most
    /// [`DEADLINE`].
    pub(crate) fn output(&mut self) -> std::io::Result<Output> {
        if !self.stdin {
            self.command.stdin(Stdio::null());
        }
        if !self.stdout {
            self.command.stdout(Stdio::piped());
        }
        if !self.stderr {
            self.command.stderr(Stdio::piped());
        }
        let child = self.command.spawn()?;
        Ok(output_within(child, &format!("`{}`", self.line)))
    }

    /// [`Command::status`], waiting at most [`DEADLINE`].
    pub(crate) fn status(&mut self) -> std::io::Result<ExitStatus> {
        let mut child = self.command.spawn()?;
        Ok(exit_within(&mut child, &format!("`{}`", self.line)))
    }
}

/// A child process that is killed and reaped when dropped, unless it was
/// waited for: a test that fails half-way leaves no `tern` running.
pub(crate) struct Reaped(Option<Child>);

impl Reaped {
    pub(crate) fn new(child: Child) -> Self {
        Self(Some(child))
    }

    /// [`Child::wait_with_output`], which takes the child, waiting at most
    /// [`DEADLINE`].
    pub(crate) fn wait_with_output(mut self) -> std::io::Result<Output> {
        Ok(output_within(
            self.0.take().expect("a child"),
            "a `tern` child",
        ))
    }

    /// [`Child::wait`], waiting at most [`DEADLINE`] (this method, not the
    /// child's, is the one `reaped.wait()` calls).
    pub(crate) fn wait(&mut self) -> std::io::Result<ExitStatus> {
        Ok(exit_within(self, "a `tern` child"))
    }
}

/// Runs `work`, which waits on process `pid` (reads its output until it
/// ends, waits for it); if `work` has not returned after [`DEADLINE`],
/// kills the process, which ends the wait, and then fails the test naming
/// `what`. For blocking reads of a child's pipes, which have no deadline
/// of their own.
pub(crate) fn killed_after_deadline<T>(pid: u32, what: &str, work: impl FnOnce() -> T) -> T {
    let (done, watching) = mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || {
        let late = matches!(
            watching.recv_timeout(DEADLINE),
            Err(mpsc::RecvTimeoutError::Timeout)
        );
        if late {
            let pid = libc::pid_t::try_from(pid).expect("a pid");
            // SAFETY: a signal to the test's own child, still unreaped (the
            // work waiting on it has not returned), so the pid is its.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        late
    });
    let value = work();
    let _ = done.send(());
    let late = watchdog.join().expect("the watchdog");
    assert!(
        !late,
        "{what} (process {pid}) still going after {DEADLINE:?}; killed"
    );
    value
}

impl Deref for Reaped {
    type Target = Child;

    fn deref(&self) -> &Child {
        self.0.as_ref().expect("a child")
    }
}

impl DerefMut for Reaped {
    fn deref_mut(&mut self) -> &mut Child {
        self.0.as_mut().expect("a child")
    }
}

impl Drop for Reaped {
    fn drop(&mut self) {
        if let Some(child) = &mut self.0
            && let Ok(None) = child.try_wait()
        {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A command's stdout as JSON, with both streams in the panic message when
/// it is not.
pub(crate) fn json(output: &Output) -> serde_json::Value {
    serde_json::from_slice(&output.stdout).unwrap_or_else(|error| {
        panic!(
            "stdout is not JSON ({error}):\n{}\nstderr:\n{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )
    })
}

/// The stdout of a command run with `--events`: its first line, a JSON
/// event (docs/cli.md, "Events"), and the bytes after it (the report).
pub(crate) fn event_and_rest(output: &Output) -> (serde_json::Value, &[u8]) {
    let stdout = &output.stdout;
    let end = stdout
        .iter()
        .position(|&byte| byte == b'\n')
        .unwrap_or_else(|| panic!("no event line on stdout: {output:?}"));
    let event = serde_json::from_slice(&stdout[..end]).unwrap_or_else(|error| {
        panic!(
            "the first line is not an event ({error}): {:?}",
            String::from_utf8_lossy(&stdout[..end])
        )
    });
    (event, &stdout[end + 1..])
}

/// Reads one line from the stdout of child `pid` (blocking until it comes,
/// or an empty string if the child exits first; the child is killed
/// after [`DEADLINE`]) and parses it as an event.
pub(crate) fn read_event(pid: u32, stdout: &mut impl std::io::BufRead) -> serde_json::Value {
    let mut line = String::new();
    killed_after_deadline(pid, "a `tern` child before its next event", || {
        stdout.read_line(&mut line)
    })
    .unwrap();
    serde_json::from_str(&line)
        .unwrap_or_else(|error| panic!("the line is not an event ({error}): {line:?}"))
}

/// A TCP port of 127.0.0.1 that was free a moment ago.
pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A `tern receive` or `tern vm receive` started on a port the system
/// picked, known from its ready event (docs/cli.md, "Events").
pub(crate) struct Receiver {
    /// Killed and reaped when dropped unless waited for (a test failed
    /// half-way, a `--keep-listening` receiver).
    pub(crate) child: Reaped,
    /// The event's `address`: what `--to` takes.
    pub address: String,
    stdout: std::io::BufReader<std::process::ChildStdout>,
}

impl Receiver {
    /// Runs `tern <command…> --listen 127.0.0.1:0 <extra…>` and waits for its
    /// ready event, the first line of its stdout.
    pub(crate) fn spawn(command: &[&str], extra: &[&str]) -> Self {
        Self::spawn_at(command, "127.0.0.1:0", extra)
    }

    /// [`Receiver::spawn`] listening on `listen`.
    pub(crate) fn spawn_at(command: &[&str], listen: &str, extra: &[&str]) -> Self {
        use std::io::BufRead;
        let mut child = tern()
            .args(command)
            .args(["--listen", listen])
            .args(extra)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .map(Reaped::new)
            .unwrap();
        let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
        // Blocks until the line arrives: the receiver prints it as soon as
        // it listens, or exits (an empty read) if it cannot.
        let mut line = String::new();
        let what = format!("`tern {}` before its ready event", command.join(" "));
        killed_after_deadline(child.id(), &what, || stdout.read_line(&mut line)).unwrap();
        let event: serde_json::Value = serde_json::from_str(&line)
            .unwrap_or_else(|error| panic!("the first line is not an event ({error}): {line:?}"));
        assert_eq!(event["event"], "listening", "{line}");
        let address = event["address"].as_str().unwrap().to_string();
        Self {
            child,
            address,
            stdout,
        }
    }

    /// Waits (up to a minute) for a line on the receiver's stderr that
    /// contains `needle`, and returns it. Takes the stderr pipe over.
    pub(crate) fn stderr_line_with(&mut self, needle: &str) -> String {
        use std::io::BufRead;
        let pipe = self.child.stderr.take().expect("stderr not taken yet");
        let (sender, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(pipe).lines() {
                let Ok(line) = line else { return };
                if sender.send(line).is_err() {
                    return;
                }
            }
        });
        let deadline = std::time::Instant::now() + DEADLINE;
        let mut seen = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match lines.recv_timeout(left) {
                Ok(line) if line.contains(needle) => return line,
                Ok(line) => seen.push(line),
                Err(_) => panic!("no stderr line with '{needle}'; saw {seen:?}"),
            }
        }
    }

    /// The bound TCP port, from the event's address.
    pub(crate) fn port(&self) -> u16 {
        let (_, port) = self.address.rsplit_once(':').expect("a TCP address");
        port.parse().expect("a port number")
    }

    /// Waits (at most [`DEADLINE`]) for the receiver to exit: its status,
    /// the rest of its stdout, its stderr.
    pub(crate) fn finish(mut self) -> (std::process::ExitStatus, Vec<u8>, String) {
        use std::io::Read;
        let pid = self.child.id();
        let stderr = self.child.stderr.take();
        let (rest, stderr) = killed_after_deadline(pid, "the receiver", || {
            // Both pipes at once: one left unread could fill and stall
            // the receiver while the other is read.
            let stderr = std::thread::spawn(move || {
                let mut text = String::new();
                if let Some(mut pipe) = stderr {
                    pipe.read_to_string(&mut text).unwrap();
                }
                text
            });
            let mut rest = Vec::new();
            self.stdout.read_to_end(&mut rest).unwrap();
            (rest, stderr.join().expect("the stderr reader"))
        });
        let status = self.child.wait().unwrap();
        (status, rest, stderr)
    }

    /// [`Receiver::finish`] for a `--json` receiver that must succeed: its
    /// report.
    pub(crate) fn report(self) -> serde_json::Value {
        let (status, rest, stderr) = self.finish();
        assert!(status.success(), "{status}: {stderr}");
        serde_json::from_slice(&rest).unwrap_or_else(|error| {
            panic!(
                "the report is not JSON ({error}):\n{}\nstderr:\n{stderr}",
                String::from_utf8_lossy(&rest)
            )
        })
    }
}

/// Waits until process `child` has read `bytes` bytes through `read`-like
/// calls (`rchar` in `/proc/PID/io`): for a receiver, proof that pages are
/// arriving, so a test can kill it in the middle of a migration without
/// guessing how long setup takes on a loaded machine.
pub(crate) fn wait_until_read(child: &std::process::Child, bytes: u64) {
    let path = format!("/proc/{}/io", child.id());
    let read = || -> u64 {
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        text.lines()
            .find_map(|line| line.strip_prefix("rchar: "))
            .and_then(|value| value.trim().parse().ok())
            .unwrap_or(0)
    };
    tern_test_skip::wait::wait_until(
        &format!("process {} has read {bytes} bytes", child.id()),
        || read() >= bytes,
    );
}

/// `--tls-dir` directories made for one test (rcgen): a CA, and one
/// directory per host with `ca.pem`, `cert.pem` and `key.pem`.
pub(crate) struct TlsDirs {
    root: tempfile::TempDir,
    ca: rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
}

impl TlsDirs {
    pub(crate) fn new() -> Self {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "tern test CA");
        let ca = rcgen::CertifiedIssuer::self_signed(params, rcgen::KeyPair::generate().unwrap())
            .unwrap();
        Self {
            root: tempfile::tempdir().unwrap(),
            ca,
        }
    }

    /// A host directory `name` with a certificate for `names`.
    pub(crate) fn host(&self, name: &str, names: &[&str]) -> String {
        self.write(
            name,
            rcgen::CertificateParams::new(to_strings(names)).unwrap(),
        )
    }

    /// A host directory `name` whose certificate expired in 2021.
    pub(crate) fn expired_host(&self, name: &str, names: &[&str]) -> String {
        let mut params = rcgen::CertificateParams::new(to_strings(names)).unwrap();
        params.not_before = rcgen::date_time_ymd(2020, 1, 1);
        params.not_after = rcgen::date_time_ymd(2021, 1, 1);
        self.write(name, params)
    }

    fn write(&self, name: &str, params: rcgen::CertificateParams) -> String {
        let dir = self.root.path().join(name);
        std::fs::create_dir(&dir).unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let certificate = params.signed_by(&key, &self.ca).unwrap();
        std::fs::write(dir.join("ca.pem"), self.ca.pem()).unwrap();
        std::fs::write(dir.join("cert.pem"), certificate.pem()).unwrap();
        std::fs::write(dir.join("key.pem"), key.serialize_pem()).unwrap();
        dir.to_str().unwrap().to_string()
    }
}

fn to_strings(names: &[&str]) -> Vec<String> {
    names.iter().map(ToString::to_string).collect()
}

/// Whether this kernel offers kernel TLS (the `tls` upper-layer protocol).
pub(crate) fn kernel_has_tls() -> bool {
    std::fs::read_to_string("/proc/sys/net/ipv4/tcp_available_ulp")
        .unwrap_or_default()
        .split_whitespace()
        .any(|ulp| ulp == "tls")
}

/// Checks a JSON report's `transport`, `tls` and `authenticated` for a
/// TCP session over mutual TLS (docs/cli.md).
pub(crate) fn assert_reports_tls(report: &serde_json::Value) {
    assert_eq!(report["transport"], "tcp", "{report}");
    assert_eq!(report["authenticated"], true, "{report}");
    let tls = &report["tls"];
    assert_eq!(tls["version"], "TLSv1_3", "{report}");
    assert!(
        tls["cipher"].as_str().unwrap().starts_with("TLS13_"),
        "{report}"
    );
    if !kernel_has_tls() {
        assert_eq!(tls["kernel-offload"], false, "user-space TLS: {report}");
    }
}
