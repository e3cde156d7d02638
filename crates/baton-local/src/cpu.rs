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
    let cpu = Cpuid::read();
    // Each check is spelled out: no loop or table here may be turned into vector code (the very
    // instructions under test).
    [
        ("avx", cfg!(target_feature = "avx"), cpu.avx()),
        ("avx2", cfg!(target_feature = "avx2"), cpu.avx() && cpu.leaf7_ebx & (1 << 5) != 0),
        ("bmi1", cfg!(target_feature = "bmi1"), cpu.leaf7_ebx & (1 << 3) != 0),
        ("bmi2", cfg!(target_feature = "bmi2"), cpu.leaf7_ebx & (1 << 8) != 0),
        ("f16c", cfg!(target_feature = "f16c"), cpu.avx() && cpu.leaf1_ecx & (1 << 29) != 0),
        ("fma", cfg!(target_feature = "fma"), cpu.avx() && cpu.leaf1_ecx & (1 << 12) != 0),
        ("lzcnt", cfg!(target_feature = "lzcnt"), cpu.ext1_ecx & (1 << 5) != 0),
        ("movbe", cfg!(target_feature = "movbe"), cpu.leaf1_ecx & (1 << 22) != 0),
        ("xsave", cfg!(target_feature = "xsave"), cpu.leaf1_ecx & (1 << 26) != 0),
    ]
}

/// The CPU's own answer, read with `cpuid`. Not `is_x86_feature_detected!`: in a build compiled
/// with a feature, that macro answers `true` for it without asking the CPU.
#[cfg(target_arch = "x86_64")]
struct Cpuid {
    leaf1_ecx: u32,
    leaf7_ebx: u32,
    ext1_ecx: u32,
    /// The OS saves the AVX registers on a context switch (XCR0 bits 1 and 2).
    os_saves_avx: bool,
}

#[cfg(target_arch = "x86_64")]
impl Cpuid {
    #[inline(never)]
    fn read() -> Cpuid {
        use std::arch::x86_64::{__cpuid, __cpuid_count};
        // Every x86-64 CPU has `cpuid`; leaves past the maximum it reports are not read.
        let max = __cpuid(0).eax;
        let leaf1_ecx = __cpuid(1).ecx;
        let leaf7_ebx = if max >= 7 { __cpuid_count(7, 0).ebx } else { 0 };
        let ext1_ecx = if __cpuid(0x8000_0000).eax >= 0x8000_0001 { __cpuid(0x8000_0001).ecx } else { 0 };
        let osxsave = leaf1_ecx & (1 << 27) != 0;
        let os_saves_avx = osxsave && xcr0() & 0b110 == 0b110;
        Cpuid { leaf1_ecx, leaf7_ebx, ext1_ecx, os_saves_avx }
    }

    fn avx(&self) -> bool {
        self.os_saves_avx && self.leaf1_ecx & (1 << 28) != 0
    }
}

/// XCR0, read with `xgetbv`; only called when the CPU reports OSXSAVE (else it faults).
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
fn xcr0() -> u64 {
    let (eax, edx): (u32, u32);
    // SAFETY: `xgetbv` with ECX = 0 reads XCR0, which the caller checked the OS enables.
    unsafe {
        std::arch::asm!("xgetbv", in("ecx") 0u32, out("eax") eax, out("edx") edx, options(nomem, nostack, preserves_flags));
    }
    (u64::from(edx) << 32) | u64::from(eax)
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

/// Runs [`exit_unless_supported`] before any other code of the binary, static constructors
/// included: the app links crates whose constructors run before `main` (Tauri records the
/// starting binary in one) and were compiled with AVX like the rest. Expand it once, in a
/// binary's `main.rs`; a low priority number puts it first in `.init_array`.
#[macro_export]
macro_rules! check_cpu_before_anything {
    () => {
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        #[allow(unsafe_code)]
        #[used]
        #[unsafe(link_section = ".init_array.00100")]
        static BATON_CPU_CHECK: extern "C" fn() = {
            extern "C" fn check() {
                $crate::cpu::exit_unless_supported();
            }
            check
        };
    };
}
