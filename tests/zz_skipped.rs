//! The end of the suite: what this `cargo test` run did not check, and why. Every test
//! that skips calls the one skip helper (src/testing/skip.rs), which records the skip in
//! this run's folder; this binary, the last of the integration tests (cargo runs them in
//! name order), reads the records, prints their count grouped by what was missing, and
//! removes the folder. A run that skipped nothing says so too.

#[path = "../src/testing/skip.rs"]
mod skip;

use std::collections::BTreeMap;
use std::io::Write;

#[test]
fn what_this_run_did_not_check() {
    let Some(dir) = skip::run_dir() else {
        let _ = writeln!(std::io::stderr(), "skips: no /proc to find this run's records by");
        return;
    };
    let mut by_need: BTreeMap<String, Vec<(String, String)>> = BTreeMap::new();
    for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
        let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
        for line in text.lines() {
            let mut parts = line.splitn(3, '\t');
            let (Some(need), Some(test), Some(why)) = (parts.next(), parts.next(), parts.next()) else {
                panic!("{}: a skip record is not <need>\\t<test>\\t<why>: {line:?}", entry.path().display());
            };
            by_need.entry(need.to_string()).or_default().push((test.to_string(), why.to_string()));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    let total: usize = by_need.values().map(Vec::len).sum();
    let mut out = String::new();
    if total == 0 {
        out += "\nskipped: nothing; every test of this run checked what it says it checks\n";
    } else {
        out += &format!("\nskipped: {total} test(s) checked less than they say, for want of:\n");
        for (need, tests) in &by_need {
            let mut why: BTreeMap<&str, usize> = BTreeMap::new();
            for (_, w) in tests {
                *why.entry(w.as_str()).or_default() += 1;
            }
            out += &format!("  {need}: {}\n", tests.len());
            for (w, n) in why {
                out += &format!("    {n} × {w}\n");
            }
        }
        out += &format!("  (set {}=1 to make a missing GPU fail the run)\n", skip::REQUIRE_GPU);
    }
    let _ = std::io::stderr().write_all(out.as_bytes());
}
