//! Whether a model can fit in the memory that is free, known before loading it, and what its
//! load took.

use std::path::Path;

/// Set to `1` to load a model that the free memory looks too small for.
pub const IGNORE_FREE_MEMORY: &str = "BATON_IGNORE_FREE_MEMORY";

/// What loading a model takes in memory at the least, known before loading it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryNeed {
    /// The weights as they are kept: on the CPU the GGUF's tensors take their file's size
    /// (the tiled x86 layout is within 3% of it), safetensors weights theirs.
    pub weights_bytes: u64,
    /// The engine's working memory beside the weights: buffers, the tokenizer, and the
    /// attention cache of a short conversation (a long one takes more as it grows).
    pub overhead_bytes: u64,
}

impl MemoryNeed {
    /// Weights plus 3% plus 256 MiB: a floor below which a load cannot succeed, not a promise
    /// that one above it will (a long conversation's attention cache grows past it).
    /// `docs/conductor-models.md` has the measured figures it rests on.
    pub fn of_weights(weights_bytes: u64) -> Self {
        MemoryNeed { weights_bytes, overhead_bytes: weights_bytes * 3 / 100 + (256 << 20) }
    }

    pub fn total_bytes(&self) -> u64 {
        self.weights_bytes + self.overhead_bytes
    }

    /// Whether `free_bytes` of free memory can hold it.
    pub fn fits(&self, free_bytes: u64) -> bool {
        self.total_bytes() <= free_bytes
    }
}

/// The weights' bytes at `path`: a GGUF file's size, or a directory's `*.safetensors` files.
pub fn weights_bytes(path: &Path) -> Option<u64> {
    if path.is_file() {
        return path.metadata().ok().map(|m| m.len());
    }
    let mut total = 0;
    for entry in std::fs::read_dir(path).ok()? {
        let entry = entry.ok()?;
        if entry.path().extension().is_some_and(|e| e == "safetensors") {
            total += entry.metadata().ok()?.len();
        }
    }
    Some(total)
}

/// The memory free for a new program: `MemAvailable` in `/proc/meminfo` (Linux; elsewhere
/// `None`, and the check is skipped), which counts caches the kernel can drop.
pub fn free_memory_bytes() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// What a model loaded on the CPU needs and the free memory, where the free memory cannot hold
/// it: a failed load takes minutes and can push the whole machine into swap first, so the
/// loader refuses it beforehand. Models that go to a GPU, and safetensors models quantized
/// while loading (their peak depends on the engine's order of work), are not checked.
pub(super) fn shortfall(path: &Path, quantized_while_loading: bool, on_cpu: bool) -> Option<(MemoryNeed, u64)> {
    if !on_cpu || quantized_while_loading || std::env::var(IGNORE_FREE_MEMORY).is_ok_and(|v| v == "1") {
        return None;
    }
    let (weights, free) = (weights_bytes(path)?, free_memory_bytes()?);
    let need = MemoryNeed::of_weights(weights);
    (!need.fits(free)).then_some((need, free))
}

/// The process's resident memory, and the part of it backed by files (Linux; `None` elsewhere).
#[derive(Debug, Clone, Copy)]
pub(super) struct Resident {
    bytes: Option<u64>,
    file_bytes: Option<u64>,
}

impl Resident {
    pub(super) fn now() -> Self {
        let status = std::fs::read_to_string("/proc/self/status").ok();
        let kib = |field: &str| -> Option<u64> {
            let line = status.as_deref()?.lines().find(|l| l.starts_with(field))?;
            Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
        };
        Resident { bytes: kib("VmRSS:"), file_bytes: kib("RssFile:") }
    }

    /// How much the resident memory, and its file-backed part, grew since `before`.
    pub(super) fn growth_since(self, before: Resident) -> (Option<u64>, Option<u64>) {
        let grown = |now: Option<u64>, then: Option<u64>| now.zip(then).map(|(now, then)| now.saturating_sub(then));
        (grown(self.bytes, before.bytes), grown(self.file_bytes, before.file_bytes))
    }
}

/// Gives the allocator's free pages back to the system. Loading reads each tensor's blocks and
/// frees them once they are repacked into tiles, and glibc keeps memory freed so in its heaps,
/// resident, for the process's life (about 24 MiB for SmolLM2-135M).
pub(super) fn release_free_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only hands free pages back to the kernel; no live allocation moves.
    #[allow(unsafe_code)]
    unsafe {
        libc::malloc_trim(0);
    }
}
