//! The desktop app is built for x86-64-v3 too; on a CPU without AVX2 it exits with a message
//! before any window or model code runs (see `crates/baton-cli/tests/cpu.rs`).

#![cfg(target_arch = "x86_64")]

use std::path::Path;

#[test]
fn on_a_cpu_without_avx2_the_app_exits_with_a_message_instead_of_crashing() {
    if !cfg!(target_feature = "avx2") {
        use std::io::Write;
        let _ = writeln!(std::io::stderr(), "SKIPPED: this build does not target AVX2, so any CPU runs it");
        return;
    }
    let bin = Path::new(env!("CARGO_BIN_EXE_baton-desktop"));
    let Some((code, stderr)) = baton_tests::run_on_emulated_cpu("Nehalem", bin, &[]) else { return };
    assert_eq!(code, Some(3), "exits 3, not by a signal: {stderr}");
    assert!(stderr.contains("needs CPU features this processor lacks (avx, avx2"), "{stderr}");
}
