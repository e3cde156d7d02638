//! The curated conductor models (`catalog.toml`, data) and which of them suit this machine.

use serde::{Deserialize, Serialize};

use crate::ModelRef;

/// One model Baton offers to download.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ts_rs::TS)]
#[serde(deny_unknown_fields)]
pub struct CatalogModel {
    pub id: String,
    pub name: String,
    /// `owner/name:file`, as `baton models pull` takes it.
    pub reference: String,
    pub quantization: String,
    /// The file's size as the hub lists it (the download reads the exact figure from the hub).
    pub size_gb: f64,
    /// What running it as the conductor takes: weights, a 4k-token context, the runtime.
    pub memory_gb: f64,
    pub licence: String,
    pub licence_url: String,
    /// Fast enough to conduct on a CPU alone.
    pub cpu: bool,
    pub summary: String,
}

#[derive(Deserialize)]
struct File {
    model: Vec<CatalogModel>,
}

/// The curated list, in order of preference (later entries are preferred when they fit).
pub fn catalog() -> Vec<CatalogModel> {
    // The file is part of the build and a test parses it, so this cannot fail in a release.
    toml::from_str::<File>(include_str!("../catalog.toml")).map(|f| f.model).unwrap_or_default()
}

impl CatalogModel {
    pub fn model_ref(&self) -> Option<ModelRef> {
        ModelRef::parse(&self.reference).ok()
    }
}

/// What this computer offers a local model.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Machine {
    /// Physical memory, when it could be read.
    pub ram_bytes: Option<u64>,
    /// The largest GPU, when one was found (an NVIDIA card through `nvidia-smi`, or Apple
    /// silicon, whose GPU shares the main memory).
    pub gpu: Option<Gpu>,
    /// Whether this build of Baton can run models on that GPU (built with CUDA or Metal).
    pub build_uses_gpu: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Gpu {
    pub name: String,
    pub memory_bytes: u64,
}

/// How a catalog model would run here.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Fit {
    /// In the GPU's memory, with a build that uses it.
    Gpu,
    /// On the CPU, in main memory, at a usable speed.
    Cpu,
    /// It fits in memory but runs slowly on a CPU (better with a GPU build).
    Slow,
    /// More than this machine's memory.
    TooBig,
}

const GB: f64 = 1e9;

impl Machine {
    /// Reads the memory and GPUs of this computer. `build_uses_gpu`: this build was compiled
    /// with CUDA or Metal.
    pub fn detect(build_uses_gpu: bool) -> Machine {
        let ram_bytes = total_memory();
        let gpu = nvidia_gpu().or_else(|| apple_gpu(ram_bytes));
        Machine { ram_bytes, gpu, build_uses_gpu }
    }

    pub fn fit(&self, model: &CatalogModel) -> Fit {
        let need = model.memory_gb * GB;
        if self.build_uses_gpu
            && let Some(gpu) = &self.gpu
            && need <= gpu.memory_bytes as f64 * 0.9
        {
            return Fit::Gpu;
        }
        // Half the memory at most: the rest of the machine (the app, a browser) needs the other half.
        let room = self.ram_bytes.map_or(8.0 * GB, |r| r as f64 * 0.5);
        match (need <= room, model.cpu) {
            (false, _) => Fit::TooBig,
            (true, true) => Fit::Cpu,
            (true, false) => Fit::Slow,
        }
    }

    /// The model to suggest first: the most preferred one that runs well here (on the GPU if
    /// the build uses one, else one fit for a CPU), else the smallest.
    pub fn recommend<'a>(&self, models: &'a [CatalogModel]) -> Option<&'a CatalogModel> {
        let well = |m: &&CatalogModel| matches!(self.fit(m), Fit::Gpu | Fit::Cpu);
        models
            .iter()
            .rev()
            .find(|m| self.fit(m) == Fit::Gpu)
            .or_else(|| models.iter().rev().find(well))
            .or_else(|| models.iter().min_by(|a, b| a.memory_gb.total_cmp(&b.memory_gb)))
    }

    /// A sentence for a machine with an NVIDIA GPU that this build does not use.
    pub fn gpu_advice(&self) -> Option<String> {
        let gpu = self.gpu.as_ref()?;
        if self.build_uses_gpu || gpu.name.starts_with("Apple") {
            return None;
        }
        Some(format!(
            "This computer has an {} ({} GB) but this build of Baton runs models on the CPU. Install the \
             CUDA toolkit (nvcc) and build again with scripts/app, which then builds for the GPU.",
            gpu.name,
            (gpu.memory_bytes as f64 / GB).round()
        ))
    }
}

fn total_memory() -> Option<u64> {
    if cfg!(target_os = "linux") {
        // "MemTotal:       24521000 kB"
        let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
        let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
        let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kb * 1024)
    } else if cfg!(target_os = "macos") {
        let out = std::process::Command::new("sysctl").args(["-n", "hw.memsize"]).output().ok()?;
        String::from_utf8_lossy(&out.stdout).trim().parse().ok()
    } else {
        None
    }
}

/// The NVIDIA card with the most memory, through `nvidia-smi` (absent without the driver).
fn nvidia_gpu() -> Option<Gpu> {
    let out = std::process::Command::new("nvidia-smi")
        .args(["--query-gpu=name,memory.total", "--format=csv,noheader,nounits"])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| {
            let (name, mib) = line.rsplit_once(',')?;
            Some(Gpu { name: name.trim().to_owned(), memory_bytes: mib.trim().parse::<u64>().ok()? * 1024 * 1024 })
        })
        .max_by_key(|g| g.memory_bytes)
}

fn apple_gpu(ram: Option<u64>) -> Option<Gpu> {
    (cfg!(all(target_os = "macos", target_arch = "aarch64")))
        .then(|| Gpu { name: "Apple silicon GPU (shared memory)".into(), memory_bytes: ram.unwrap_or(0) * 3 / 4 })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn machine(ram_gb: u64, gpu_gb: Option<u64>, build_uses_gpu: bool) -> Machine {
        Machine {
            ram_bytes: Some(ram_gb * 1_000_000_000),
            gpu: gpu_gb.map(|g| Gpu { name: "NVIDIA RTX".into(), memory_bytes: g * 1_000_000_000 }),
            build_uses_gpu,
        }
    }

    #[test]
    fn the_catalog_parses_and_every_entry_is_a_pullable_gguf() {
        let models = catalog();
        assert!(models.len() >= 4, "{models:?}");
        for m in &models {
            let r = m.model_ref().unwrap_or_else(|| panic!("{} is not a reference", m.reference));
            assert!(r.file.ends_with(".gguf"), "{}", m.reference);
            assert!(m.size_gb > 0.0 && m.memory_gb > m.size_gb, "{}: memory covers the weights", m.id);
            assert!(m.licence_url.starts_with("https://"), "{}", m.id);
        }
        let ids: std::collections::HashSet<_> = models.iter().map(|m| &m.id).collect();
        assert_eq!(ids.len(), models.len(), "ids are unique");
    }

    #[test]
    fn the_recommendation_follows_the_machine() {
        let models = catalog();
        let pick = |m: Machine| m.recommend(&models).map(|c| c.id.clone()).unwrap_or_default();
        // A laptop without a GPU: the CPU model.
        assert_eq!(pick(machine(16, None, false)), "qwen2.5-1.5b-instruct-q4_k_m");
        // A 12 GB card with a CUDA build: the largest that fits in it.
        assert_eq!(pick(machine(32, Some(12), true)), "qwen2.5-7b-instruct-q4_k_m");
        // A 4 GB card: the 7B does not fit, a 3B does.
        assert_eq!(pick(machine(32, Some(4), true)), "qwen2.5-3b-instruct-q4_k_m");
        // The same card, but the build runs on the CPU: the CPU model, and advice to rebuild.
        let cpu_build = machine(32, Some(12), false);
        assert_eq!(pick(cpu_build.clone()), "qwen2.5-1.5b-instruct-q4_k_m");
        assert!(cpu_build.gpu_advice().is_some_and(|a| a.contains("CUDA") && a.contains("scripts/app")));
        assert_eq!(machine(32, Some(12), true).gpu_advice(), None);
        // Too little memory for any: still the smallest, marked too big.
        let tiny = machine(2, None, false);
        assert_eq!(pick(tiny.clone()), "qwen2.5-1.5b-instruct-q4_k_m");
        assert_eq!(tiny.fit(&models[0]), Fit::TooBig);
        assert_eq!(machine(16, None, false).fit(&models[3]), Fit::Slow);
    }
}
