//! `tern ctl SOCKET COMMAND [NAME=VALUE ...]`: one command to a control
//! socket, its answer on stdout; or `events`, the events as they come.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use serde_json::{Map, Value, json};

use crate::args::ctl::CtlArgs;

/// Exit status when the socket refused the command (its error on stderr).
pub const REFUSED: u8 = 1;

/// `tern ctl`.
pub fn run(args: &CtlArgs) -> anyhow::Result<ExitCode> {
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
        return print_events(&mut reader);
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

/// Prints each event line until the final status change or the end of
/// the connection.
fn print_events(reader: &mut impl BufRead) -> anyhow::Result<ExitCode> {
    loop {
        let event = match read_object(reader) {
            Ok(event) => event,
            Err(_) => return Ok(ExitCode::SUCCESS),
        };
        println!("{event}");
        let status = event["data"]["status"].as_str().unwrap_or_default();
        let final_status = matches!(
            status,
            "completed" | "failed" | "cancelled" | "outcome-unknown"
        );
        if event["event"] == "MIGRATION" && final_status {
            return Ok(ExitCode::SUCCESS);
        }
    }
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
pub fn parse_arguments(pairs: &[String]) -> anyhow::Result<Value> {
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
