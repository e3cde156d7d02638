//! The `baton` binary is built for x86-64-v3 (AVX2, FMA, …). On a CPU without those features it
//! must say so and exit, not die of SIGILL somewhere in the model code: run it on an emulated
//! CPU that lacks them (QEMU raises SIGILL for an AVX instruction there, as the CPU would).

#![cfg(target_arch = "x86_64")]

use std::path::Path;

#[test]
fn on_a_cpu_without_avx2_baton_exits_with_a_message_instead_of_crashing() {
    if !cfg!(target_feature = "avx2") {
        use std::io::Write;
        let _ = writeln!(std::io::stderr(), "SKIPPED: this build does not target AVX2, so any CPU runs it");
        return;
    }
    let bin = Path::new(env!("CARGO_BIN_EXE_baton"));
    // A CPU that has every feature runs it as usual: the emulator itself is not the problem.
    let Some((code, stderr)) = baton_tests::run_on_emulated_cpu("Haswell", bin, &["--version"]) else { return };
    assert_eq!(code, Some(0), "{stderr}");

    let (code, stderr) = baton_tests::run_on_emulated_cpu("Nehalem", bin, &["--version"]).expect("the emulator ran");
    assert_eq!(code, Some(3), "exits 3, not by a signal: {stderr}");
    assert!(stderr.contains("needs CPU features this processor lacks (avx, avx2, bmi1, bmi2, f16c, fma"), "{stderr}");
    assert!(stderr.contains("target-cpu=native"), "says how to build for this CPU: {stderr}");
}
