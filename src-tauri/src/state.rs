//! What the shell keeps between commands: where files live, the open history, the local models
//! loaded so far, and a cancel switch per run in flight.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;

use baton_engine::Pool;
use baton_local::LocalModels;
use baton_store::Store;
use tokio_util::sync::CancellationToken;

use crate::error::{AppError, AppResult};

/// The files the app reads and writes. `BATON_POOL` and `BATON_DB` override the defaults, as for
/// the `baton` command line (the end-to-end tests use them to stay out of the user's files).
#[derive(Debug, Clone)]
pub struct Paths {
    pub pool: PathBuf,
    pub db: PathBuf,
    /// Where model downloads go (`BATON_MODELS_DIR`, else the hub cache in Baton's data directory).
    pub models: PathBuf,
}

impl Paths {
    pub fn from_env() -> Paths {
        let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
        Paths {
            pool: var("BATON_POOL").unwrap_or_else(|| {
                baton_engine::pool::default_pool_path(&dirs::config_dir().unwrap_or_else(|| PathBuf::from(".")))
            }),
            db: var("BATON_DB")
                .unwrap_or_else(|| baton_store::default_path(&dirs::data_dir().unwrap_or_else(|| PathBuf::from(".")))),
            models: baton_models::Cache::default_root(),
        }
    }
}

/// Asks the user where to save a file (given a suggested name); `None` when they cancel.
pub type SaveDialog =
    std::sync::Arc<dyn Fn(String) -> futures::future::BoxFuture<'static, Option<PathBuf>> + Send + Sync>;

pub struct AppState {
    pub paths: Paths,
    store: tokio::sync::OnceCell<Store>,
    /// Local models loaded so far; a load blocks only other uses of the same model file.
    pub models: LocalModels,
    /// Cancel switches of the runs and plan drafts in flight, by the id the window gave each.
    /// Entries live exactly as long as their [`Registration`].
    pub runs: Mutex<HashMap<String, CancellationToken>>,
    /// Where exports go: the native save dialog, opened from here so the webview cannot name a
    /// path. Tests that run without a window answer it themselves ([`AppState::with_save_dialog`]).
    pub save_dialog: Option<SaveDialog>,
    /// The Local API server, while it runs.
    pub local_api: LocalApi,
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState").field("paths", &self.paths).field("models", &self.models).finish_non_exhaustive()
    }
}

impl AppState {
    pub fn new(paths: Paths) -> AppState {
        AppState {
            paths,
            store: tokio::sync::OnceCell::new(),
            models: LocalModels::default(),
            runs: Mutex::new(HashMap::new()),
            save_dialog: None,
            local_api: Default::default(),
        }
    }

    /// Answers the save dialog with `dialog` instead of asking the user (no window to ask in).
    pub fn with_save_dialog(mut self, dialog: SaveDialog) -> AppState {
        self.save_dialog = Some(dialog);
        self
    }

    /// The history, opened on first use; an error (damaged file, …) is retried on the next call.
    pub async fn store(&self) -> AppResult<&Store> {
        Ok(self.store.get_or_try_init(|| Store::open(&self.paths.db)).await?)
    }

    /// The pool as the file says now: settings saved a moment ago apply to the next run.
    pub fn pool(&self) -> AppResult<Pool> {
        Ok(Pool::load(&self.paths.pool)?)
    }

    /// Makes work with this `id` stoppable by `cancel_run` until the registration drops,
    /// however the work ends (an early error included). An id already in use is refused, so
    /// one piece of work can never take over another's cancel switch.
    pub fn register(&self, id: &str) -> AppResult<Registration<'_>> {
        let token = CancellationToken::new();
        let mut runs = self.runs.lock().unwrap_or_else(|p| p.into_inner());
        if runs.contains_key(id) {
            return Err(AppError::bad_input(format!("work with the id {id} is already going")));
        }
        runs.insert(id.to_owned(), token.clone());
        Ok(Registration { runs: &self.runs, id: id.to_owned(), token })
    }
}

/// A run or draft that `cancel_run` can stop; see [`AppState::register`].
#[derive(Debug)]
pub struct Registration<'a> {
    runs: &'a Mutex<HashMap<String, CancellationToken>>,
    id: String,
    pub token: CancellationToken,
}

impl Drop for Registration<'_> {
    fn drop(&mut self) {
        self.runs.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.id);
    }
}

/// The server the app runs, when it runs.
pub(crate) struct Running {
    pub(crate) service: std::sync::Arc<baton_serve::Service>,
    pub(crate) shutdown: CancellationToken,
    pub(crate) task: tokio::task::JoinHandle<std::io::Result<()>>,
    pub(crate) url: String,
    /// The pool file's text when the server started.
    pub(crate) pool_text: String,
}

/// The Local API's place in [`AppState`]: the server while it runs, and why the last start failed.
#[derive(Default)]
pub struct LocalApi {
    pub(crate) running: tokio::sync::Mutex<(Option<Running>, Option<String>)>,
}

impl std::fmt::Debug for LocalApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalApi").finish_non_exhaustive()
    }
}
