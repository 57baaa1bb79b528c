//! Durations and sizes as flags and files write them: one parser and one printer for
//! each, shared by every part.

use std::time::Duration;

/// Parses a duration: a number with `ms`, `s` or `m`, or `0`. Fractions are allowed
/// (`1.5s`).
///
/// # Errors
/// A message naming the accepted forms.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    let err = || format!("{s:?} is not a duration (want e.g. 250ms, 5s, 1.5m, or 0)");
    let (number, unit_secs) = if let Some(n) = s.strip_suffix("ms") {
        (n, 0.001)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = s.strip_suffix('m') {
        (n, 60.0)
    } else {
        return Err(err());
    };
    if number.is_empty() || !number.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return Err(err());
    }
    let n: f64 = number.parse().map_err(|_| err())?;
    let d = Duration::try_from_secs_f64(n * unit_secs).map_err(|_| err())?;
    if d > MAX_DURATION {
        return Err(format!(
            "{s:?} is longer than the longest duration accepted ({}m, 365 days)",
            MAX_DURATION.as_secs() / 60
        ));
    }
    Ok(d)
}

/// The longest duration a flag takes: deadlines derived from it (now plus a budget,
/// plus a drain) stay far from the clock's end.
pub const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);

/// Parses a size in bytes: a whole number, optionally with `KiB`, `MiB` or `GiB`.
///
/// # Errors
/// A message naming the accepted forms.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let err = || format!("{s:?} is not a size (want e.g. 65536, 512KiB, 64MiB, 1GiB)");
    let (number, unit) = [("KiB", 1u64 << 10), ("MiB", 1 << 20), ("GiB", 1 << 30)]
        .iter()
        .find_map(|(suffix, unit)| s.strip_suffix(suffix).map(|n| (n, *unit)))
        .unwrap_or((s, 1));
    if number.is_empty() || !number.bytes().all(|b| b.is_ascii_digit()) {
        return Err(err());
    }
    number
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(unit))
        .ok_or_else(err)
}

/// Formats a size the way [`parse_bytes`] reads it, in the largest exact unit.
pub fn fmt_bytes(n: u64) -> String {
    for (suffix, unit) in [("GiB", 1u64 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)] {
        if n >= unit && n.is_multiple_of(unit) {
            return format!("{}{suffix}", n / unit);
        }
    }
    n.to_string()
}

/// Formats a duration the way [`parse_duration`] reads it.
pub fn fmt_duration(d: Duration) -> String {
    if d.is_zero() {
        "0s".to_owned()
    } else if d.subsec_nanos().is_multiple_of(1_000_000) && d < Duration::from_secs(1) {
        format!("{}ms", d.as_millis())
    } else if d.subsec_nanos() == 0 {
        format!("{}s", d.as_secs())
    } else {
        format!("{}s", d.as_secs_f64())
    }
}
