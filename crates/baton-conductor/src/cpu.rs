//! The CPU features this binary was compiled to use, and a check that the CPU it runs on has
//! them.
//!
//! x86-64 builds target x86-64-v3 (`.cargo/config.toml`): candle picks its quantized matmul
//! kernels at compile time, so a build for the x86-64 baseline decodes about half as fast. Such
//! a binary may use AVX2 anywhere, and on a CPU without it would die of SIGILL with no word of
//! why. [`exit_unless_supported`] runs first thing in `main` and says what is missing instead.

/// Features a build may be compiled for that the CPU must then have, in the order of
/// x86-64-v3's definition. `compiled` is fixed at compile time.
#[cfg(target_arch = "x86_64")]
fn features() -> [(&'static str, bool, bool); 9] {
    // Each check is spelled out: the macro needs a literal, and no loop or table here may be
    // turned into vector code (the very instructions under test).
    [
        ("avx", cfg!(target_feature = "avx"), std::arch::is_x86_feature_detected!("avx")),
        ("avx2", cfg!(target_feature = "avx2"), std::arch::is_x86_feature_detected!("avx2")),
        ("bmi1", cfg!(target_feature = "bmi1"), std::arch::is_x86_feature_detected!("bmi1")),
        ("bmi2", cfg!(target_feature = "bmi2"), std::arch::is_x86_feature_detected!("bmi2")),
        ("f16c", cfg!(target_feature = "f16c"), std::arch::is_x86_feature_detected!("f16c")),
        ("fma", cfg!(target_feature = "fma"), std::arch::is_x86_feature_detected!("fma")),
        ("lzcnt", cfg!(target_feature = "lzcnt"), std::arch::is_x86_feature_detected!("lzcnt")),
        ("movbe", cfg!(target_feature = "movbe"), std::arch::is_x86_feature_detected!("movbe")),
        ("xsave", cfg!(target_feature = "xsave"), std::arch::is_x86_feature_detected!("xsave")),
    ]
}

/// The features this binary was compiled to use that this CPU lacks.
pub fn missing_features() -> Vec<&'static str> {
    #[cfg(target_arch = "x86_64")]
    return features().into_iter().filter(|(_, compiled, present)| *compiled && !*present).map(|(n, ..)| n).collect();
    #[cfg(not(target_arch = "x86_64"))]
    Vec::new()
}

/// The SIMD level the model code was compiled for, for reports: `x86-64-v3 (AVX2, FMA, F16C)`,
/// `x86-64 baseline (SSE2)`, or the architecture's name elsewhere.
pub fn simd_level() -> &'static str {
    if cfg!(all(target_arch = "x86_64", target_feature = "avx512f")) {
        "x86-64-v4 (AVX-512, AVX2, FMA, F16C)"
    } else if cfg!(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma")) {
        "x86-64-v3 (AVX2, FMA, F16C)"
    } else if cfg!(target_arch = "x86_64") {
        "x86-64 baseline (SSE2): slow; see \"Older x86-64 CPUs\" in the README"
    } else if cfg!(target_arch = "aarch64") {
        "aarch64 (NEON)"
    } else {
        std::env::consts::ARCH
    }
}

/// Exits with a message, before any model code runs, when this CPU lacks a feature the binary
/// was compiled for. Call it first thing in `main`.
///
/// Kept out of line and plain: nothing in it may itself use the instructions it checks for
/// (a test runs the binaries on an emulated CPU without them).
#[inline(never)]
pub fn exit_unless_supported() {
    #[cfg(target_arch = "x86_64")]
    {
        let mut missing = String::new();
        for (name, compiled, present) in features() {
            if compiled && !present {
                if !missing.is_empty() {
                    missing.push_str(", ");
                }
                missing.push_str(name);
            }
        }
        if !missing.is_empty() {
            eprintln!(
                "error: this build of Baton needs CPU features this processor lacks ({missing}): it was built for \
                 x86-64-v3 (AVX2, FMA; Intel since 2013, AMD since 2015). Build it for this CPU instead: \
                 RUSTFLAGS=\"-C target-cpu=native\" scripts/app (see \"Older x86-64 CPUs\" in the README)."
            );
            std::process::exit(3);
        }
    }
}
