//! What the process sets up for the engine before anything else runs, and what this build runs
//! local models on.

/// What this build runs local models on: `cuda`, `metal` or `cpu`, fixed when it was compiled
/// (`scripts/app` builds for the GPU when it finds the CUDA toolkit or Apple silicon).
pub const BUILD_DEVICE: &str = if cfg!(feature = "cuda") {
    "cuda"
} else if cfg!(feature = "metal") {
    "metal"
} else {
    "cpu"
};

/// Sets the environment the engine reads, before anything else runs.
///
/// - mistral.rs's Hugging Face cache goes into Baton's own data directory and stays offline.
///   mistral.rs creates that cache even for local models; nothing should land in the user's home
///   cache, and a local model must never reach for the network.
/// - Libraries' errors carry no backtrace (`RUST_LIB_BACKTRACE=0`) unless the user sets that
///   variable. With `RUST_BACKTRACE=1` in a shell, every candle and anyhow error captured one,
///   and an error turned into text resolved it: loading a GGUF formats such an error for an
///   optional metadata field it reads, which read the binary's debug information into memory
///   for the process's life (44 MiB beside SmolLM2's 94 MiB of weights, measured with
///   `baton bench conductor`); a candle error shown to a user would carry the backtrace too.
///   `RUST_BACKTRACE` still gives backtraces on a panic.
/// - The allocator keeps freed memory for reuse ([`keep_freed_memory`]).
///
/// # Safety
///
/// It sets environment variables, so it must run before any other thread exists (the async
/// runtime, a webview): call it first thing in `main`.
#[allow(unsafe_code)]
pub unsafe fn set_engine_environment() {
    let dir = dirs::data_dir().unwrap_or_else(std::env::temp_dir).join("baton").join("hf");
    // SAFETY: the caller guarantees no other thread exists yet, so nothing reads the
    // environment concurrently.
    unsafe {
        std::env::set_var("HF_HOME", &dir);
        std::env::set_var("HF_HUB_OFFLINE", "1");
        if std::env::var_os("RUST_LIB_BACKTRACE").is_none() {
            std::env::set_var("RUST_LIB_BACKTRACE", "0");
        }
    }
    keep_freed_memory();
}

/// Has glibc keep the memory a local model's prompt frees, for the next layer to reuse.
///
/// A prompt allocates each layer's activations afresh: for Qwen2.5-1.5B and a 585-token prompt,
/// blocks of up to 21 MiB, dozens a layer. By default glibc maps blocks above its mmap
/// threshold on their own and gives the top of a heap back to the system once 128 KiB of it is
/// free, so nearly every block came back as new pages, which the kernel zeroes on first touch:
/// page faults and zeroing were about a tenth of the prompt's time. Now blocks up to 32 MiB
/// (the most glibc allows) come from the heaps, the heaps keep what is freed, and they grow
/// 256 MiB at a time (address space; only touched pages are resident). The 1.5B's 585-token
/// prompt ran about 10% faster on a 2-core Xeon, medians of three runs each, with the same peak
/// resident memory (the prompt's buffers were resident at their peak anyway). Loading a model
/// still hands free pages back when it is done (`malloc_trim`), so the memory a loaded model is
/// reported to take does not change.
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes glibc's allocation policy; it is called before other threads
    // exist, and glibc serialises it with allocation anyway.
    #[allow(unsafe_code)]
    unsafe {
        const MIB: libc::c_int = 1 << 20;
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 * MIB);
        libc::mallopt(libc::M_TRIM_THRESHOLD, libc::c_int::MAX);
        libc::mallopt(libc::M_TOP_PAD, 256 * MIB);
    }
}
