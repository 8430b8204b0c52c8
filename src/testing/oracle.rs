//! Where the PyTorch reference cases are (the crate's tests and the integration tests
//! both read them, this file being included by tests/common): `LOCKSTEP_ORACLE_DIR` if
//! set, else `shared/oracle` beside the checkout, as CI lays it out.

use std::path::PathBuf;

/// The folder of the reference case `name` (e.g. `toy_s0_k50_b64_w1`).
pub fn oracle_case(name: &str) -> PathBuf {
    match std::env::var_os("LOCKSTEP_ORACLE_DIR") {
        Some(dir) => PathBuf::from(dir).join(name),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/oracle").join(name),
    }
}
