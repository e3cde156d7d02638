//! Baton's desktop app: a thin Tauri shell over the engine crates. Commands live next to the
//! engine piece they expose (`chat`, `settings`, `keys`, `history`); each returns
//! [`error::AppError`] (`{kind, message}`) on failure. A run's `RunEvent`s travel on a `Channel`
//! of its own; app-wide news (model loading, history warnings) are events.

pub mod bindings;
pub mod chat;
pub mod error;
pub mod eval;
pub mod history;
pub mod keys;
pub mod learn;
pub mod local_api;
pub mod models;
pub mod settings;
pub mod state;
pub mod timing;

use serde::Serialize;
use tauri::Runtime;

pub use state::{AppState, Paths};

#[derive(Debug, Clone, PartialEq, Serialize, ts_rs::TS)]
pub struct AppInfo {
    pub version: String,
    /// Whether this build runs local models (the conductor needs one, or a server).
    pub local_models: bool,
    /// Whether local models can use a GPU in this build.
    pub gpu: bool,
    /// Where the app (and the command line) write their logs.
    pub log_dir: String,
    /// What this build runs local models on: `cuda`, `metal` or `cpu`.
    pub build_device: String,
    /// On a machine with an NVIDIA GPU this build does not use: how to build for it.
    pub gpu_advice: Option<String>,
}

#[tauri::command]
fn app_info() -> AppInfo {
    AppInfo {
        version: env!("CARGO_PKG_VERSION").to_owned(),
        local_models: cfg!(feature = "local"),
        gpu: cfg!(any(feature = "cuda", feature = "metal")),
        log_dir: baton_engine::logs::log_dir().display().to_string(),
        build_device: baton_local::BUILD_DEVICE.to_owned(),
        gpu_advice: baton_models::catalog::Machine::detect(baton_local::BUILD_DEVICE != "cpu").gpu_advice(),
    }
}

/// Opens the log directory in the desktop's file manager (what to attach to a problem report).
#[tauri::command]
fn open_logs_folder() -> Result<String, error::AppError> {
    let dir = baton_engine::logs::log_dir();
    let io = |e: std::io::Error| {
        error::AppError::new(error::ErrorKind::Io, format!("{}: cannot open the logs folder: {e}", dir.display()))
    };
    std::fs::create_dir_all(&dir).map_err(io)?;
    let opener = if cfg!(target_os = "macos") {
        "open"
    } else if cfg!(windows) {
        "explorer"
    } else {
        "xdg-open"
    };
    let mut opener = std::process::Command::new(opener).arg(&dir).spawn().map_err(io)?;
    // Reaped off the command's thread so it leaves no zombie, whatever the opener takes.
    std::thread::spawn(move || opener.wait());
    Ok(dir.display().to_string())
}

/// The app on top of `base`: `run` starts from the real webview's builder, the command tests
/// from Tauri's mock runtime.
pub fn builder<R: Runtime>(base: tauri::Builder<R>, state: AppState) -> tauri::Builder<R> {
    base.plugin(tauri_plugin_dialog::init())
        .manage(state)
        .invoke_handler(tauri::generate_handler![
            app_info,
            open_logs_folder,
            settings::get_settings,
            settings::save_settings,
            chat::load_conductor,
            chat::ask,
            chat::rerun_step,
            chat::ask_compared,
            chat::mark_comparison,
            chat::cancel_run,
            chat::draft_plan,
            chat::validate_plan,
            chat::test_worker,
            keys::list_keys,
            keys::set_key,
            keys::delete_key,
            keys::allow_env_key,
            history::list_conversations,
            history::set_conversation_choices,
            history::get_conversation,
            history::conversation_runs,
            history::list_runs,
            history::search_history,
            history::get_run,
            history::delete_run,
            history::delete_conversation,
            history::export_history,
            history::worker_figures,
            history::conversation_comparisons,
            history::export_preferences,
            models::model_catalog,
            models::pull_model,
            models::delete_model,
            models::loaded_models,
            eval::eval_suites,
            eval::run_evaluation,
            eval::list_evaluations,
            eval::get_evaluation,
            eval::delete_evaluation,
            eval::export_evaluation,
            learn::pool_learning,
            learn::learn_pool,
            local_api::local_api_status,
            local_api::save_local_api,
            local_api::restart_local_api,
            local_api::local_api_token,
        ])
        .setup(|app| {
            tauri::async_runtime::spawn(local_api::start_at_launch(app.handle().clone()));
            Ok(())
        })
}

/// The app's configuration, capabilities and (in release builds) embedded UI, from
/// `tauri.conf.json`. Generic so the command tests run it on the mock runtime.
pub fn context<R: Runtime>() -> tauri::Context<R> {
    tauri::generate_context!()
}

/// Opens the main window; returns when the app quits.
pub fn run() {
    // Without a log the app still works; the reason goes to stderr.
    let _log = baton_engine::logs::init("baton-desktop").map_err(|e| eprintln!("warning: no log file: {e}")).ok();
    builder(tauri::Builder::default(), AppState::new(Paths::from_env()))
        .build(context())
        .expect("Baton could not start its window (is a display available?)")
        .run(|_, event| {
            // The event loop ends the process without returning here, so `_log` is never
            // dropped: the lines it still holds are written now.
            if let tauri::RunEvent::Exit = event {
                baton_engine::logs::flush();
            }
        });
}
