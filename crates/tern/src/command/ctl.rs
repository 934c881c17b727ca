//! `tern ctl SOCKET COMMAND [NAME=VALUE ...]`: one command to a control
//! socket, its answer on stdout; or `events`, the events kept so far
//! (`query-events`) and then the events as they come, each once.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use serde_json::{Map, Value, json};

use crate::args::ctl::CtlArgs;

/// Exit status when the socket refused the command (its error on stderr).
pub(crate) const REFUSED: u8 = 1;

/// `tern ctl`.
pub(crate) fn run(args: &CtlArgs) -> anyhow::Result<ExitCode> {
    let stream = UnixStream::connect(&args.socket)
        .with_context(|| format!("cannot connect to {}", args.socket.display()))?;
    let timeout = Duration::from_secs(args.timeout.max(1));
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let greeting = read_object(&mut reader)?;
    if let Some(error) = greeting.get("error") {
        anyhow::bail!(
            "the control socket refused this client: {}",
            describe(error)
        );
    }
    anyhow::ensure!(
        greeting.get("QMP").is_some(),
        "{} did not greet as a control socket: {greeting}",
        args.socket.display()
    );
    if args.command == "events" {
        if !args.no_history {
            let mut writer = stream.try_clone()?;
            writeln!(writer, r#"{{"execute":"query-events","id":"history"}}"#)
                .context("cannot ask for the events kept")?;
        }
        return print_events(&mut reader, !args.no_history);
    }
    let request = json!({
        "execute": args.command,
        "arguments": parse_arguments(&args.arguments)?,
        "id": 1,
    });
    let mut writer = stream;
    writeln!(writer, "{request}").context("cannot send the command")?;
    loop {
        let reply = read_object(&mut reader)?;
        if reply.get("event").is_some() {
            continue;
        }
        if let Some(value) = reply.get("return") {
            println!("{value}");
            return Ok(ExitCode::SUCCESS);
        }
        if let Some(error) = reply.get("error") {
            eprintln!("tern ctl: {}", describe(error));
            return Ok(ExitCode::from(REFUSED));
        }
        anyhow::bail!("unexpected reply: {reply}");
    }
}

/// Prints the events the command kept (when `history`: the answer to
/// `query-events`, with the events pushed before it), then each event as
/// it comes, each once (by `seq`), until the final status change or the
/// end of the connection.
fn print_events(reader: &mut impl BufRead, history: bool) -> anyhow::Result<ExitCode> {
    let mut printed = 0;
    let mut early = Vec::new();
    if history {
        loop {
            let line = match read_object(reader) {
                Ok(line) => line,
                Err(_) => return Ok(ExitCode::SUCCESS),
            };
            if line.get("event").is_some() {
                early.push(line);
                continue;
            }
            // A command without query-events (CommandNotFound) has no
            // history to give: the live events alone.
            let kept = line["return"]["events"].as_array().cloned();
            early.splice(0..0, kept.unwrap_or_default());
            break;
        }
    }
    // All of what was kept, even past the final status change (a RESUME
    // after a paused hand-over).
    let mut ended = false;
    for event in early {
        ended |= print_event(&event, &mut printed);
    }
    if ended {
        return Ok(ExitCode::SUCCESS);
    }
    loop {
        let event = match read_object(reader) {
            Ok(event) => event,
            Err(_) => return Ok(ExitCode::SUCCESS),
        };
        if event.get("event").is_some() && print_event(&event, &mut printed) {
            return Ok(ExitCode::SUCCESS);
        }
    }
}

/// Prints `event` unless its `seq` is not past the last one printed;
/// whether it was the final status change.
fn print_event(event: &Value, printed: &mut u64) -> bool {
    match event["seq"].as_u64() {
        Some(seq) if seq > 0 && seq <= *printed => return false,
        Some(seq) => *printed = seq,
        None => {}
    }
    println!("{event}");
    let status = event["data"]["status"].as_str().unwrap_or_default();
    let final_status = matches!(
        status,
        "completed" | "failed" | "cancelled" | "outcome-unknown"
    );
    event["event"] == "MIGRATION" && final_status
}

fn read_object(reader: &mut impl BufRead) -> anyhow::Result<Value> {
    let mut line = String::new();
    let read = reader
        .read_line(&mut line)
        .context("no answer from the control socket")?;
    anyhow::ensure!(read > 0, "the control socket closed the connection");
    serde_json::from_str(&line).with_context(|| format!("not JSON: {line:?}"))
}

fn describe(error: &Value) -> String {
    format!(
        "{}: {}",
        error["class"].as_str().unwrap_or("Error"),
        error["desc"].as_str().unwrap_or("(no description)")
    )
}

/// NAME=VALUE pairs as a JSON object.
pub(crate) fn parse_arguments(pairs: &[String]) -> anyhow::Result<Value> {
    let mut arguments = Map::new();
    for pair in pairs {
        let Some((name, value)) = pair.split_once('=') else {
            anyhow::bail!("argument {pair:?} is not NAME=VALUE");
        };
        let value = serde_json::from_str(value).unwrap_or_else(|_| Value::String(value.into()));
        arguments.insert(name.to_string(), value);
    }
    Ok(Value::Object(arguments))
}

#[cfg(test)]
mod tests {
    use super::parse_arguments;

    #[test]
    fn arguments_are_json_when_they_parse() {
        let arguments = parse_arguments(&[
            "max-bandwidth=8388608".into(),
            "auto-converge=false".into(),
            "name=plain".into(),
        ])
        .unwrap();
        assert_eq!(arguments["max-bandwidth"], 8_388_608);
        assert_eq!(arguments["auto-converge"], false);
        assert_eq!(arguments["name"], "plain");
        assert!(parse_arguments(&["nothing".into()]).is_err());
    }
}
