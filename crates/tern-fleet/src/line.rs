//! One JSON object per line, with a length limit: the framing both ends of
//! the agent's socket use.

use std::io::{BufRead, Read, Write};

/// Why a line could not be read.
#[derive(Debug)]
pub(crate) enum LineError {
    /// The connection ended (or failed).
    Closed,
    /// The line was longer than the limit.
    TooLong,
}

/// The next non-empty line, without its newline.
pub(crate) fn read_line(reader: &mut impl BufRead, limit: u64) -> Result<Vec<u8>, LineError> {
    loop {
        let mut line = Vec::new();
        match reader.take(limit + 1).read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => return Err(LineError::Closed),
            Ok(_) => {}
        }
        if line.len() as u64 > limit {
            return Err(LineError::TooLong);
        }
        if !line.iter().all(u8::is_ascii_whitespace) {
            if line.last() == Some(&b'\n') {
                line.pop();
            }
            return Ok(line);
        }
    }
}

/// Writes `line` and a newline.
pub(crate) fn write_line(writer: &mut impl Write, line: &str) -> std::io::Result<()> {
    let mut bytes = Vec::with_capacity(line.len() + 1);
    bytes.extend_from_slice(line.as_bytes());
    bytes.push(b'\n');
    writer.write_all(&bytes)
}
