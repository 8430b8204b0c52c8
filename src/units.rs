//! Quantities as people read them: bytes in decimal units ("52.6 GB") and counts with
//! thousands separators ("98,442").
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
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
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
}
