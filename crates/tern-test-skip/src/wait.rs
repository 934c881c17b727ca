//! Bounded waits for tests: a test waits for a condition, a thread or a
//! child process, never for a time, and never without a deadline. Each
//! wait polls until what it waits for has happened, and after
//! [`DEADLINE`] fails the test with a message naming what did not
//! happen: if a product deadline stops working, the test goes red
//! instead of hanging the run.
//!
//! ```
//! use tern_test_skip::wait::{join_within, wait_until};
//!
//! let flag = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
//! let setter = std::sync::Arc::clone(&flag);
//! let thread = std::thread::spawn(move || {
//!     setter.store(true, std::sync::atomic::Ordering::SeqCst);
//!     7
//! });
//! wait_until("the thread sets the flag", || {
//!     flag.load(std::sync::atomic::Ordering::SeqCst)
//! });
//! assert_eq!(join_within(thread, "the setter"), 7);
//! ```

use std::io::{Read, Write};
use std::process::{Child, ExitStatus, Output};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long a test waits for something that should happen soon: far beyond
/// any scheduling delay on a loaded machine, so only a hang reaches it, and
/// well inside the per-test timeout of `.config/nextest.toml` (3 minutes).
pub const DEADLINE: Duration = Duration::from_secs(60);

/// The longest pause between two polls: short against any deadline, long
/// enough that a check that runs a process does not busy a core.
const LONGEST_POLL: Duration = Duration::from_millis(16);

/// Polls `check` until it returns a value and returns it; panics naming
/// `what` after [`DEADLINE`]. Like every wait here that panics, the panic
/// names the test's line that waited (`#[track_caller]`), not this file.
#[track_caller]
pub fn wait_for<T>(what: &str, check: impl FnMut() -> Option<T>) -> T {
    wait_for_within(DEADLINE, what, check)
}

#[track_caller]
fn wait_for_within<T>(limit: Duration, what: &str, mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + limit;
    let mut pause = Duration::from_millis(1);
    loop {
        if let Some(value) = check() {
            return value;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?} waiting until {what}"
        );
        std::thread::sleep(pause);
        pause = (pause * 2).min(LONGEST_POLL);
    }
}

/// Polls `condition` until it holds; panics naming `what` after
/// [`DEADLINE`].
#[track_caller]
pub fn wait_until(what: &str, mut condition: impl FnMut() -> bool) {
    wait_for(what, || condition().then_some(()));
}

/// Joins `thread` once it has finished; panics naming `what` after
/// [`DEADLINE`] (the thread is left behind; the test process ends with
/// the failure). A panic of the thread is the test's panic.
#[track_caller]
pub fn join_within<T>(thread: JoinHandle<T>, what: &str) -> T {
    wait_until(&format!("{what} ends"), || thread.is_finished());
    match thread.join() {
        Ok(value) => value,
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

/// Waits for `child` to exit and returns its status; after [`DEADLINE`],
/// kills and reaps it and panics naming `what`.
#[track_caller]
pub fn exit_within(child: &mut Child, what: &str) -> ExitStatus {
    exit_before(child, what, DEADLINE)
}

#[track_caller]
fn exit_before(child: &mut Child, what: &str, limit: Duration) -> ExitStatus {
    let deadline = Instant::now() + limit;
    let mut pause = Duration::from_millis(1);
    loop {
        if let Some(status) = child.try_wait().expect("try_wait on a child") {
            return status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{what} (process {}) still running after {limit:?}; killed",
                child.id()
            );
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(LONGEST_POLL);
    }
}

/// [`Child::wait_with_output`] with [`DEADLINE`]: reads the child's piped
/// standard output and error (empty where not piped) while waiting for it
/// to exit; after the deadline kills it and panics naming `what`.
#[track_caller]
pub fn output_within(mut child: Child, what: &str) -> Output {
    let stdout = child.stdout.take().map(read_on_thread);
    let stderr = child.stderr.take().map(read_on_thread);
    let status = exit_within(&mut child, what);
    // The pipes close when the child exits, unless it handed them to a
    // process that lives on: bounded too.
    let collect = |reader: Option<JoinHandle<Vec<u8>>>, stream: &str| {
        reader.map_or_else(Vec::new, |reader| {
            join_within(reader, &format!("reading the {stream} of {what}"))
        })
    };
    Output {
        status,
        stdout: collect(stdout, "stdout"),
        stderr: collect(stderr, "stderr"),
    }
}

/// Runs `work`, a wait that cannot be polled (a fault on memory a
/// userfaultfd handler serves, a blocking read no kill can end); if it has
/// not returned after [`DEADLINE`], writes what is blocked on standard
/// error and ends the whole test process with a failure status (101, a
/// failed test's), since the blocked thread cannot be interrupted. Under
/// cargo-nextest, which runs each test in its own process, that fails just
/// this test.
pub fn exit_after_deadline<T>(what: &str, work: impl FnOnce() -> T) -> T {
    let (done, watching) = std::sync::mpsc::channel::<()>();
    let what = what.to_string();
    let watchdog = std::thread::spawn(move || {
        if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = watching.recv_timeout(DEADLINE) {
            let _ = writeln!(
                std::io::stderr(),
                "FAILED: still blocked after {DEADLINE:?} waiting until {what}; the test process exits"
            );
            std::process::exit(101);
        }
    });
    let value = work();
    let _ = done.send(());
    let _ = watchdog.join();
    value
}

/// [`std::thread::scope`] under [`exit_after_deadline`]: a scope joins its
/// threads before it returns, so one whose threads wait on the product (a
/// fault a handler must serve, a barrier, a cancelled dial) cannot be left
/// behind; one still running after [`DEADLINE`] ends the test process,
/// naming `what`.
pub fn scope_within<'env, T>(
    what: &str,
    body: impl for<'scope> FnOnce(&'scope std::thread::Scope<'scope, 'env>) -> T,
) -> T {
    exit_after_deadline(what, || std::thread::scope(body))
}

fn read_on_thread(mut pipe: impl Read + Send + 'static) -> JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = pipe.read_to_end(&mut bytes);
        bytes
    })
}

#[cfg(test)]
mod tests {
    use super::{exit_before, exit_within, join_within, output_within, wait_for, wait_for_within};
    use std::process::{Command, Stdio};
    use std::time::Duration;

    #[test]
    #[should_panic(expected = "timed out after 50ms waiting until the impossible")]
    fn a_condition_that_never_holds_fails_naming_it() {
        wait_for_within(Duration::from_millis(50), "the impossible", || None::<()>);
    }

    #[test]
    fn a_child_that_outlives_the_deadline_is_killed_and_named() {
        let mut child = Command::new("sleep").arg("600").spawn().unwrap();
        let pid = child.id();
        let failure = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            exit_before(&mut child, "the sleeper", Duration::from_millis(50))
        }))
        .expect_err("the wait fails");
        let message = failure.downcast_ref::<String>().unwrap();
        assert_eq!(
            message,
            &format!("the sleeper (process {pid}) still running after 50ms; killed")
        );
        // Reaped by the failed wait: nothing left to wait for.
        assert!(child.try_wait().unwrap().is_some());
    }

    #[test]
    fn a_failed_wait_names_the_line_that_waited() {
        let waited_at = std::sync::Arc::new(std::sync::Mutex::new(None));
        let record = std::sync::Arc::clone(&waited_at);
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let ours = info
                .payload()
                .downcast_ref::<String>()
                .is_some_and(|message| message.contains("the line that waited"));
            if ours {
                *record.lock().unwrap() =
                    info.location().map(|at| (at.file().to_string(), at.line()));
            }
        }));
        let line = line!() + 2;
        let failure = std::panic::catch_unwind(|| {
            wait_for_within(Duration::from_millis(10), "the line that waited", || {
                None::<()>
            })
        });
        std::panic::set_hook(previous);
        assert!(failure.is_err());
        assert_eq!(
            waited_at.lock().unwrap().clone(),
            Some((file!().to_string(), line))
        );
    }

    #[test]
    fn a_value_is_returned_once_the_check_finds_it() {
        let mut polls = 0;
        let found = wait_for("the third poll", || {
            polls += 1;
            (polls == 3).then_some(polls * 10)
        });
        assert_eq!(found, 30);
    }

    #[test]
    #[should_panic(expected = "the joined thread panicked on purpose")]
    fn a_joined_thread_s_panic_is_the_test_s() {
        let thread = std::thread::spawn(|| panic!("the joined thread panicked on purpose"));
        join_within(thread, "a panicking thread");
    }

    #[test]
    fn a_child_s_output_and_status_are_collected() {
        let child = Command::new("sh")
            .args(["-c", "echo out; echo err >&2; exit 3"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let output = output_within(child, "sh");
        assert_eq!(output.status.code(), Some(3));
        assert_eq!(output.stdout, b"out\n");
        assert_eq!(output.stderr, b"err\n");
    }

    #[test]
    fn an_exited_child_s_status_is_returned() {
        let mut child = Command::new("true").spawn().unwrap();
        assert!(exit_within(&mut child, "true").success());
    }
}
