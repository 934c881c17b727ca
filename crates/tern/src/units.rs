//! Parsing and printing sizes and rates.

/// Parses a byte size: a number with an optional unit. Binary units (K, M,
/// G, T, KiB, MiB, GiB, TiB) are powers of 1024; KB, MB, GB and TB are powers
/// of 1000; a bare number is bytes.
pub(crate) fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("'{text}' is not a size (examples: 4GiB, 512M, 100MB, 4096)"))?;
    let multiplier: f64 = match unit.trim() {
        "" | "B" => 1.0,
        "K" | "KiB" | "k" => 1024.0,
        "M" | "MiB" => 1024.0 * 1024.0,
        "G" | "GiB" => 1024.0 * 1024.0 * 1024.0,
        "T" | "TiB" => 1024.0f64.powi(4),
        "KB" | "kB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        "TB" => 1e12,
        other => return Err(format!("unknown unit '{other}' in '{text}'")),
    };
    let bytes = value * multiplier;
    if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
        return Err(format!("'{text}' is out of range"));
    }
    Ok(whole_u64(bytes))
}

/// Parses a rate in bytes per second: a size, optionally followed by `/s`.
/// Bit rates (decimal) are accepted with a `bit` or `bps` unit: `1Gbit`,
/// `100Mbit/s`, `10Gbps`, `500Kbps`.
pub(crate) fn parse_rate(text: &str) -> Result<u64, String> {
    let text = text.trim().trim_end_matches("/s");
    for (suffix, bits) in [
        ("Gbit", 1e9),
        ("Mbit", 1e6),
        ("Kbit", 1e3),
        ("kbit", 1e3),
        ("Gbps", 1e9),
        ("Mbps", 1e6),
        ("Kbps", 1e3),
        ("kbps", 1e3),
    ] {
        if let Some(number) = text.strip_suffix(suffix) {
            let value: f64 = number
                .trim()
                .parse()
                .map_err(|_| format!("'{text}' is not a rate"))?;
            return Ok(whole_u64(value * bits / 8.0));
        }
    }
    parse_size(text)
}

/// `value`'s whole part as a `u64`: negatives and NaN become 0, values
/// past `u64::MAX` become `u64::MAX`.
pub(crate) fn whole_u64(value: f64) -> u64 {
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "float-to-integer `as` saturates at both ends and maps NaN to 0: \
                  the clamp documented above"
    )]
    let whole = value as u64;
    whole
}

/// Bytes in binary units, for people.
pub(crate) fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4GiB"), Ok(4 << 30));
        assert_eq!(parse_size("512M"), Ok(512 << 20));
        assert_eq!(parse_size("100MB"), Ok(100_000_000));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("1.5G"), Ok(3 << 29));
        assert!(parse_size("lots").is_err());
        assert!(parse_size("5XB").is_err());
    }

    #[test]
    fn rates() {
        assert_eq!(parse_rate("1Gbit"), Ok(125_000_000));
        assert_eq!(parse_rate("100MiB/s"), Ok(100 << 20));
        assert_eq!(parse_rate("1Gbps"), Ok(125_000_000));
        assert_eq!(parse_rate("100Mbps"), Ok(12_500_000));
        assert_eq!(parse_rate("8Kbps"), Ok(1000));
        assert_eq!(parse_rate("8kbit/s"), Ok(1000));
        assert!(parse_rate("fastGbps").is_err());
        assert_eq!(human_bytes(3 << 30), "3.00 GiB");
    }
}
