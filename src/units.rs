//! Quantities as people read them: bytes in decimal units ("52.6 GB"), counts with
//! thousands separators ("98,442"), and spans of time ("3h50m", read and written).
//!
//! Owns the formatting only, for every message that states a size: the library's errors
//! (`Error::OutOfMemory`), the memory estimate's parts (`memory`), the command line's
//! lines. A leaf: it imports nothing of the crate, so that the error type, which
//! everything imports, can use it without importing what it formats.

/// Bytes in decimal units with one decimal: "52.6 GB", "230.4 kB", "17 B".
pub fn human(bytes: u64) -> String {
    const UNITS: [(&str, f64); 4] = [("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)];
    for (unit, size) in UNITS {
        if bytes as f64 >= size {
            return format!("{:.1} {unit}", bytes as f64 / size);
        }
    }
    format!("{bytes} B")
}

/// A count with thousands separators: 98,442.
pub fn count(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A span of time as a person or a batch scheduler writes it: a number of seconds
/// ("5400", "0.5"), units in descending order ("90s", "45m", "3h50m", "1.5h", "2d"; the
/// units are d, h, m and s), or Slurm's clock: `MM:SS`, `HH:MM:SS` and, after a number
/// of days, `D-HH`, `D-HH:MM`, `D-HH:MM:SS` ("1:30:00", "2-00:00:00"), whose minutes and
/// seconds are below 60 and whose hours after days are below 24. The error quotes the
/// text.
#[cfg(any(test, feature = "cli"))]
pub fn parse_duration(text: &str) -> Result<std::time::Duration, String> {
    let bad = |why: &str| format!("'{text}' is not a duration ({why}); write e.g. 90s, 45m, 3h50m or 1:30:00");
    let t = text.trim();
    if t.is_empty() {
        return Err(bad("empty"));
    }
    if t.starts_with('-') {
        return Err(bad("negative: a time limit is 0 or more"));
    }
    let number = |s: &str| -> Result<f64, String> {
        match s.parse::<f64>() {
            Ok(x) if x.is_finite() && x >= 0.0 && !s.starts_with('+') => Ok(x),
            Ok(_) => Err(bad("not a non-negative number")),
            Err(_) => Err(bad(&format!("'{s}' is not a number"))),
        }
    };
    let seconds = if t.contains([':', '-']) {
        // Slurm's forms: the parts' units from the left after days, from the right without.
        let (days, clock) = match t.split_once('-') {
            Some((d, rest)) => (Some(number(d)?), rest),
            None => (None, t),
        };
        let parts: Vec<&str> = clock.split(':').collect();
        if parts.len() > 3 || parts.iter().any(|p| p.is_empty()) {
            return Err(bad("a clock is MM:SS, HH:MM:SS or D-HH:MM:SS"));
        }
        // Each part's unit, its seconds, and the bound it stays below unless it comes first.
        const PARTS: [(&str, f64, f64); 3] =
            [("hours", 3_600.0, 24.0), ("minutes", 60.0, 60.0), ("seconds", 1.0, 60.0)];
        let units = match days {
            Some(_) => &PARTS[..parts.len()],
            None => &PARTS[3 - parts.len()..],
        };
        let mut s = days.unwrap_or(0.0) * 86_400.0;
        for (i, (p, &(unit, seconds, limit))) in parts.iter().zip(units).enumerate() {
            let x = number(p)?;
            // The first part of a clock without days counts as far as it likes (90:00).
            if (i > 0 || days.is_some()) && x >= limit {
                return Err(bad(&format!("{p} {unit}: a clock's {unit} are below {limit}")));
            }
            s += x * seconds;
        }
        s
    } else if t.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        number(t)?
    } else {
        const UNITS: [(&str, f64); 4] = [("d", 86_400.0), ("h", 3_600.0), ("m", 60.0), ("s", 1.0)];
        let (mut rest, mut total, mut next_unit) = (t, 0.0, 0);
        while !rest.is_empty() {
            let end =
                rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).ok_or_else(|| bad("a number without a unit"))?;
            let (value, after) = rest.split_at(end);
            // The unit: every letter up to the next number ("ms" is one unit, not m then s).
            let unit_len = after.find(|c: char| c.is_ascii_digit() || c == '.').unwrap_or(after.len());
            let unit = &after[..unit_len];
            let k = UNITS
                .iter()
                .position(|(u, _)| *u == unit)
                .ok_or_else(|| bad(&format!("unknown unit '{unit}': the units are d, h, m and s, as in 1d2h3m4.5s")))?;
            if value.is_empty() {
                return Err(bad(&format!("no number before '{unit}'")));
            }
            if k < next_unit {
                return Err(bad("units go from days to seconds, each once"));
            }
            total += number(value)? * UNITS[k].1;
            next_unit = k + 1;
            rest = &after[unit_len..];
        }
        total
    };
    std::time::Duration::try_from_secs_f64(seconds).map_err(|_| bad("too long"))
}

/// A span of time in the units a person reads: "3h50m", "45m", "1m30s", "12.5s".
pub fn duration(d: std::time::Duration) -> String {
    let whole = d.as_secs();
    if whole < 60 {
        let s = d.as_secs_f64();
        return if s.fract() == 0.0 { format!("{whole}s") } else { format!("{s:.1}s") };
    }
    let (h, m, s) = (whole / 3600, whole / 60 % 60, whole % 60);
    let mut out = String::new();
    for (value, unit) in [(h, 'h'), (m, 'm'), (s, 's')] {
        if value > 0 {
            out.push_str(&format!("{value}{unit}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_sizes_and_counts() {
        assert_eq!(human(17), "17 B");
        assert_eq!(human(230_400), "230.4 kB");
        assert_eq!(human(52_600_000_000), "52.6 GB");
        assert_eq!(count(2_000_022_010), "2,000,022,010");
        assert_eq!(count(752), "752");
    }

    #[test]
    fn durations_read_as_written_and_bad_ones_are_quoted() {
        let secs = |t: &str| parse_duration(t).map(|d| d.as_secs_f64());
        for (text, s) in [
            ("5400", 5400.0),
            ("0.5", 0.5),
            ("90s", 90.0),
            ("45m", 2700.0),
            ("3h50m", 13_800.0),
            ("1.5h", 5400.0),
            ("2d", 172_800.0),
            ("1h0m30s", 3630.0),
            ("1:30:00", 5400.0),
            ("05:00", 300.0),
            ("2-00:00:00", 172_800.0),
            // Slurm's forms after days count hours first: 2 days 5 hours, not 5 seconds.
            ("2-05", 190_800.0),
            ("2-05:30", 192_600.0),
            ("90:00", 5400.0),
            ("1:59:59", 7199.0),
        ] {
            assert_eq!(secs(text), Ok(s), "{text}");
        }
        for (text, why) in [
            ("", "empty"),
            ("-5", "negative"),
            ("10x", "unknown unit 'x'"),
            ("5m3h", "units go from days to seconds"),
            ("5m5m", "units go from days to seconds"),
            ("1:2:3:4", "HH:MM:SS"),
            ("1::2", "HH:MM:SS"),
            ("h", "no number before 'h'"),
            ("1ms", "unknown unit 'ms': the units are d, h, m and s"),
            ("1m5x", "unknown unit 'x'"),
            ("1:99:00", "99 minutes: a clock's minutes are below 60"),
            ("1:00:60", "60 seconds: a clock's seconds are below 60"),
            ("5:60", "60 seconds"),
            ("1-24:00:00", "24 hours: a clock's hours are below 24"),
            ("-1s", "negative: a time limit is 0 or more"),
            ("12", ""),
        ] {
            match parse_duration(text) {
                Ok(d) => assert!(why.is_empty(), "{text} read as {d:?}"),
                Err(e) => {
                    assert!(e.starts_with(&format!("'{text}' is not a duration")) && e.contains(why), "{text}: {e}")
                }
            }
        }
        assert_eq!(duration(std::time::Duration::from_secs(13_800)), "3h50m");
        assert_eq!(duration(std::time::Duration::from_secs(90)), "1m30s");
        assert_eq!(duration(std::time::Duration::from_millis(12_500)), "12.5s");
        assert_eq!(duration(std::time::Duration::from_secs(45)), "45s");
    }
}
