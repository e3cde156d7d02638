//! Conductor models in the app: the curated list for this computer, downloads from the Hugging
//! Face hub, and deleting them. A download runs in the shell, not in a window: its progress is
//! broadcast (`model-download`) to every window, so a look at another screen loses nothing, and
//! `cancel_run` stops it by the id the window gave it, as for runs.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use baton_models::catalog::{Fit, Machine};
use baton_models::{Cache, Hub, ModelRef, Phase, PullError};
use serde::Serialize;
use tauri::{AppHandle, Emitter, Runtime, State};

use crate::error::{AppError, AppResult, ErrorKind};
use crate::state::AppState;

/// Broadcast while a model downloads, and once when it ends.
pub const DOWNLOAD_EVENT: &str = "model-download";

/// A curated conductor model, as this computer would run it.
#[derive(Debug, Clone, PartialEq, Serialize, ts_rs::TS)]
pub struct ModelChoice {
    /// The catalog's entry, as `catalog.toml` has it.
    #[serde(flatten)]
    #[ts(flatten)]
    pub model: baton_models::catalog::CatalogModel,
    /// `gpu`, `cpu`, `slow` (fits, but slow on a CPU) or `too_big`.
    pub fit: String,
    pub recommended: bool,
    /// The downloaded file, when it is here.
    pub path: Option<String>,
}

/// A model file in the download folder, whole or partly downloaded.
#[derive(Debug, Clone, PartialEq, Serialize, ts_rs::TS)]
pub struct DownloadedModel {
    pub reference: String,
    pub path: String,
    pub bytes: u64,
    pub size: u64,
    pub complete: bool,
}

/// Everything the model picker shows.
#[derive(Debug, Clone, PartialEq, Serialize, ts_rs::TS)]
pub struct ModelCatalog {
    pub models: Vec<ModelChoice>,
    /// This computer in a line: memory and GPU.
    pub machine: String,
    /// What this build runs local models on: `cuda`, `metal` or `cpu`.
    pub build_device: String,
    /// On a machine with an NVIDIA GPU this build does not use: how to build for it.
    pub gpu_advice: Option<String>,
    /// Where downloads go.
    pub models_dir: String,
    /// The hub downloads come from (`HF_ENDPOINT` or huggingface.co).
    pub hub: String,
    pub downloaded: Vec<DownloadedModel>,
}

/// How a download stands; broadcast on [`DOWNLOAD_EVENT`].
#[derive(Debug, Clone, PartialEq, Serialize, ts_rs::TS)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum Download {
    Running {
        reference: String,
        /// `resolving`, `checking` (reading back an earlier part), `downloading`, `reconnecting`.
        phase: String,
        done: u64,
        total: u64,
        /// Over the last few seconds; 0 until there is a measure.
        bytes_per_sec: f64,
        eta_secs: Option<f64>,
    },
    Finished {
        reference: String,
        path: String,
        size: u64,
        /// The SHA-256 the file was checked against (`null` for a small non-LFS file).
        sha256: Option<String>,
        /// Where it went on from (0: from the start).
        resumed_from: u64,
        /// It was downloaded already.
        cached: bool,
    },
    Failed {
        reference: String,
        /// `gated`, `not_found`, `unreachable`, `hub`, `checksum`, `no_space`, `busy`, `io`.
        kind: String,
        message: String,
    },
    Stopped {
        reference: String,
        have: u64,
        size: u64,
    },
}

fn parse(reference: &str) -> AppResult<ModelRef> {
    ModelRef::parse(reference).map_err(|e| AppError::bad_input(e.to_string()))
}

fn machine() -> Machine {
    Machine::detect(baton_local::BUILD_DEVICE != "cpu")
}

/// The curated conductor models for this computer and what is downloaded.
#[tauri::command]
pub async fn model_catalog(state: State<'_, AppState>) -> AppResult<ModelCatalog> {
    let cache = Cache::new(state.paths.models.clone());
    // nvidia-smi and the folder walk take a moment: off the async workers.
    let catalog = tokio::task::spawn_blocking(move || {
        let machine = machine();
        let models = baton_models::catalog::catalog();
        let recommended = machine.recommend(&models).map(|m| m.id.clone());
        let choices = models
            .iter()
            .map(|m| ModelChoice {
                model: m.clone(),
                fit: match machine.fit(m) {
                    Fit::Gpu => "gpu",
                    Fit::Cpu => "cpu",
                    Fit::Slow => "slow",
                    Fit::TooBig => "too_big",
                }
                .to_owned(),
                recommended: recommended.as_deref() == Some(m.id.as_str()),
                path: m.model_ref().and_then(|r| cache.find(&r)).map(|p| p.display().to_string()),
            })
            .collect();
        let downloaded = cache
            .list()
            .unwrap_or_default()
            .into_iter()
            .map(|e| DownloadedModel {
                reference: e.reference.to_string(),
                path: e.path.display().to_string(),
                bytes: e.bytes,
                size: e.size,
                complete: e.complete,
            })
            .collect();
        let ram = machine
            .ram_bytes
            .map_or("memory unknown".to_owned(), |r| format!("{} memory", baton_models::human_bytes(r)));
        let line = match &machine.gpu {
            Some(g) => format!("{ram}, {} ({})", g.name, baton_models::human_bytes(g.memory_bytes)),
            None => format!("{ram}, no GPU found"),
        };
        ModelCatalog {
            models: choices,
            machine: line,
            build_device: baton_local::BUILD_DEVICE.to_owned(),
            gpu_advice: machine.gpu_advice(),
            models_dir: cache.root().display().to_string(),
            hub: String::new(),
            downloaded,
        }
    })
    .await
    .map_err(|e| AppError::new(ErrorKind::Io, format!("reading the model list failed: {e}")))?;
    // The endpoint only: no token needed (and no keychain prompt) to say where downloads come from.
    Ok(ModelCatalog { hub: Hub::from_env(|_| None).endpoint().to_owned(), ..catalog })
}

/// The hub from `HF_ENDPOINT`, with `HF_TOKEN` or a token kept with `baton keys set
/// huggingface` (read off the async workers: the keychain is a D-Bus round trip).
async fn hub() -> Hub {
    tokio::task::spawn_blocking(|| {
        Hub::from_env(|endpoint| {
            let store = baton_secrets::KeyStore::open().ok()?;
            let key = store.get(&baton_models::token_account(endpoint)).ok()??;
            Some(key.expose().to_owned())
        })
    })
    .await
    .unwrap_or_else(|_| Hub::new("https://huggingface.co", None))
}

/// Speed over the last few seconds of samples.
#[derive(Debug, Default)]
struct Speedometer {
    samples: VecDeque<(Instant, u64)>,
}

impl Speedometer {
    const WINDOW: Duration = Duration::from_secs(5);

    fn add(&mut self, done: u64) -> f64 {
        let now = Instant::now();
        self.samples.push_back((now, done));
        while self.samples.len() > 2 && self.samples.front().is_some_and(|(t, _)| now - *t > Self::WINDOW) {
            self.samples.pop_front();
        }
        match (self.samples.front(), self.samples.back()) {
            (Some((t0, d0)), Some((t1, d1))) if t1 > t0 && d1 >= d0 => (d1 - d0) as f64 / (*t1 - *t0).as_secs_f64(),
            _ => 0.0,
        }
    }

    fn reset(&mut self) {
        self.samples.clear();
    }
}

/// Downloads `reference` (`owner/name:file`) into Baton's model folder and returns the file's
/// path; an interrupted download of it resumes. Progress goes to every window on
/// [`DOWNLOAD_EVENT`]; `cancel_run(stop_id)` stops it, keeping what is on disk.
#[tauri::command]
pub async fn pull_model<R: Runtime>(
    app: AppHandle<R>,
    state: State<'_, AppState>,
    reference: String,
    stop_id: String,
) -> AppResult<String> {
    let reference = parse(&reference)?;
    let registration = state.register(&stop_id)?;
    let cache = Cache::new(state.paths.models.clone());
    let hub = hub().await;
    let name = reference.to_string();
    tracing::info!(reference = %name, hub = hub.endpoint(), "model download started");
    let mut speed = Speedometer::default();
    let mut phase = Phase::Resolving;
    let emitter = app.clone();
    let progress_name = name.clone();
    let mut on_progress = move |p: baton_models::Progress| {
        if p.phase != phase {
            phase = p.phase;
            speed.reset();
        }
        let bytes_per_sec = if p.phase == Phase::Downloading { speed.add(p.done) } else { 0.0 };
        let eta_secs = (bytes_per_sec > 0.0).then(|| (p.total.saturating_sub(p.done)) as f64 / bytes_per_sec);
        let phase = match p.phase {
            Phase::Resolving => "resolving",
            Phase::Checking => "checking",
            Phase::Downloading => "downloading",
            Phase::Reconnecting => "reconnecting",
        };
        let _ = emitter.emit(
            DOWNLOAD_EVENT,
            Download::Running {
                reference: progress_name.clone(),
                phase: phase.to_owned(),
                done: p.done,
                total: p.total,
                bytes_per_sec,
                eta_secs,
            },
        );
    };
    let result = hub.pull(&cache, &reference, &mut on_progress, &registration.token).await;
    let (event, outcome) = match result {
        Ok(pulled) => {
            tracing::info!(reference = %name, size = pulled.size, fetched = pulled.fetched, "model download finished");
            let path = pulled.path.display().to_string();
            let event = Download::Finished {
                reference: name.clone(),
                path: path.clone(),
                size: pulled.size,
                sha256: pulled.sha256,
                resumed_from: pulled.resumed_from,
                cached: pulled.cached,
            };
            (event, Ok(path))
        }
        Err(PullError::Cancelled { have, size }) => {
            let message = PullError::Cancelled { have, size }.to_string();
            (
                Download::Stopped { reference: name.clone(), have, size },
                Err(AppError::new(ErrorKind::Cancelled, message)),
            )
        }
        Err(e) => {
            let event = Download::Failed { reference: name.clone(), kind: e.kind().to_owned(), message: e.to_string() };
            (event, Err(AppError::new(ErrorKind::Download, e.to_string())))
        }
    };
    let _ = app.emit(DOWNLOAD_EVENT, event);
    outcome
}

/// Deletes a downloaded (or partly downloaded) model file.
#[tauri::command]
pub async fn delete_model(state: State<'_, AppState>, reference: String) -> AppResult<()> {
    let reference = parse(&reference)?;
    let cache = Cache::new(state.paths.models.clone());
    match cache.remove(&reference) {
        Ok(true) => Ok(()),
        Ok(false) => Err(AppError::not_found(format!("{reference} is not downloaded"))),
        Err(e) => Err(AppError::new(ErrorKind::Io, format!("cannot delete {reference}: {e}"))),
    }
}

/// The local models loaded now: device, memory, and the speed of their latest generation.
#[tauri::command]
pub fn loaded_models(state: State<'_, AppState>) -> Vec<baton_local::LoadedModel> {
    state.models.loaded()
}
