// Baton's commands are permissioned like plugin commands: the main window gets exactly the set
// in `permissions/app.toml`, so a command added here but not granted there is refused.
fn main() {
    tauri_build::try_build(
        tauri_build::Attributes::new().app_manifest(tauri_build::AppManifest::new().commands(COMMANDS)),
    )
    .expect("tauri build script failed");
}

/// Every `#[tauri::command]` the shell registers (see `src/lib.rs`).
const COMMANDS: &[&str] = &[
    "get_settings",
    "save_settings",
    "load_conductor",
    "list_keys",
    "set_key",
    "delete_key",
    "allow_env_key",
    "test_worker",
    "draft_plan",
    "ask",
    "rerun_step",
    "cancel_run",
    "list_conversations",
    "set_conversation_choices",
    "get_conversation",
    "conversation_runs",
    "list_runs",
    "worker_figures",
    "conversation_comparisons",
    "export_preferences",
    "ask_compared",
    "mark_comparison",
    "search_history",
    "get_run",
    "delete_run",
    "delete_conversation",
    "export_history",
    "validate_plan",
    "app_info",
    "open_logs_folder",
    "model_catalog",
    "pull_model",
    "delete_model",
    "loaded_models",
    "eval_suites",
    "run_evaluation",
    "pool_learning",
    "learn_pool",
    "list_evaluations",
    "get_evaluation",
    "delete_evaluation",
    "export_evaluation",
    "local_api_status",
    "save_local_api",
    "restart_local_api",
    "local_api_token",
];
