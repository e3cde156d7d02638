//! History commands: every run the app (or the `baton` command line) recorded, read-only.

use baton_store::{ConversationSummary, RunSummary, RunTree, SearchHit, export};
use serde::{Deserialize, Serialize};
use tauri::{AppHandle, Runtime, State};
use tauri_plugin_dialog::DialogExt;

use crate::error::{AppError, AppResult, ErrorKind};
use crate::state::AppState;

const PAGE: u32 = 100;

/// Conversations, most recently active first; `before` is the last `updated_at` of the previous page.
#[tauri::command]
pub async fn list_conversations(
    state: State<'_, AppState>,
    before: Option<i64>,
) -> AppResult<Vec<ConversationSummary>> {
    Ok(state.store().await?.list_conversations(PAGE, before).await?)
}

/// One conversation: its title, size and choices.
#[tauri::command]
pub async fn get_conversation(state: State<'_, AppState>, id: i64) -> AppResult<ConversationSummary> {
    state
        .store()
        .await?
        .conversation(id)
        .await?
        .ok_or_else(|| AppError::not_found(format!("there is no conversation {id} in the history")))
}

/// Keeps a conversation's choices: the workers it may use (by name; `null` for all) and
/// whether its plans are reviewed before they run.
#[tauri::command]
pub async fn set_conversation_choices(
    state: State<'_, AppState>,
    id: i64,
    workers: Option<Vec<String>>,
    review: bool,
) -> AppResult<()> {
    if workers.as_ref().is_some_and(Vec::is_empty) {
        return Err(AppError::bad_input("choose at least one worker for this conversation"));
    }
    if !state.store().await?.set_conversation_choices(id, workers.as_deref(), review).await? {
        return Err(AppError::not_found(format!("there is no conversation {id} in the history")));
    }
    Ok(())
}

/// Per worker over the whole history (evaluations' runs included): calls, failures, latency,
/// tokens, dollars, and accuracy alone from the newest evaluation that ran it.
#[tauri::command]
pub async fn worker_figures(state: State<'_, AppState>) -> AppResult<Vec<baton_store::figures::WorkerFigures>> {
    Ok(state.store().await?.worker_figures().await?)
}

/// A conversation's comparisons (compare in chat), oldest first: which run is the worker's
/// answer beside which conductor's, and the mark.
#[tauri::command]
pub async fn conversation_comparisons(
    state: State<'_, AppState>,
    id: i64,
) -> AppResult<Vec<baton_store::comparisons::ChatComparison>> {
    Ok(state.store().await?.comparisons(id).await?)
}

/// Asks where in the save dialog and writes every marked comparison there as preference pairs
/// (JSON lines: `prompt`, `chosen`, `rejected`, ...); the path, or `null` if cancelled.
#[tauri::command]
pub async fn export_preferences<R: Runtime>(
    app: AppHandle<R>,
    state: State<'_, AppState>,
) -> AppResult<Option<String>> {
    let pairs = state.store().await?.preference_pairs().await?;
    if pairs.is_empty() {
        return Err(AppError::bad_input(
            "no comparison is marked yet: compare answers in the chat and mark the better one first",
        ));
    }
    let text: String = pairs.iter().map(|p| serde_json::to_string(p).unwrap_or_default() + "\n").collect();
    save_as(&app, &state, "baton-preferences.jsonl".into(), "JSON lines", "jsonl", &text).await
}

/// A conversation's runs, oldest first, each whole (plans, steps, events).
#[tauri::command]
pub async fn conversation_runs(state: State<'_, AppState>, id: i64) -> AppResult<Vec<RunTree>> {
    let store = state.store().await?;
    let mut trees = Vec::new();
    for run in store.conversation_runs(id).await? {
        if let Some(tree) = store.run(run.id).await? {
            trees.push(tree);
        }
    }
    Ok(trees)
}

/// Runs, newest first; `before` is the last id of the previous page.
#[tauri::command]
pub async fn list_runs(state: State<'_, AppState>, before: Option<i64>) -> AppResult<Vec<RunSummary>> {
    Ok(state.store().await?.list_runs(PAGE, before).await?)
}

#[tauri::command]
pub async fn search_history(state: State<'_, AppState>, query: String) -> AppResult<Vec<SearchHit>> {
    Ok(state.store().await?.search(&query, PAGE).await?)
}

#[tauri::command]
pub async fn get_run(state: State<'_, AppState>, id: i64) -> AppResult<RunTree> {
    state
        .store()
        .await?
        .run(id)
        .await?
        .ok_or_else(|| AppError::not_found(format!("there is no run {id} in the history")))
}

#[tauri::command]
pub async fn delete_run(state: State<'_, AppState>, id: i64) -> AppResult<()> {
    match state.store().await?.delete_run(id).await? {
        true => Ok(()),
        false => Err(AppError::not_found(format!("there is no run {id} in the history"))),
    }
}

#[tauri::command]
pub async fn delete_conversation(state: State<'_, AppState>, id: i64) -> AppResult<()> {
    match state.store().await?.delete_conversation(id).await? {
        true => Ok(()),
        false => Err(AppError::not_found(format!("there is no conversation {id} in the history"))),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ts_rs::TS)]
#[serde(rename_all = "snake_case")]
pub enum ExportFormat {
    Markdown,
    Json,
}

/// What to export: one run or a whole conversation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ts_rs::TS)]
#[serde(tag = "kind", content = "id", rename_all = "snake_case")]
pub enum ExportTarget {
    Run(i64),
    Conversation(i64),
}

/// Asks where to save an export in the native save dialog, opened here rather than by the
/// window, so the window cannot choose a path (say `~/.ssh/authorized_keys`); writes it there.
/// Returns the path written, or `null` when the user cancelled.
#[tauri::command]
pub async fn export_history<R: Runtime>(
    app: AppHandle<R>,
    state: State<'_, AppState>,
    target: ExportTarget,
    format: ExportFormat,
) -> AppResult<Option<String>> {
    // The export is made first: a run that is not there fails before the dialog opens.
    let text = export_text(state.store().await?, target, format).await?;
    let (kind, id) = match target {
        ExportTarget::Run(id) => ("run", id),
        ExportTarget::Conversation(id) => ("conversation", id),
    };
    let (label, ext) = match format {
        ExportFormat::Markdown => ("Markdown", "md"),
        ExportFormat::Json => ("JSON", "json"),
    };
    save_as(&app, &state, format!("baton-{kind}-{id}.{ext}"), label, ext, &text).await
}

/// Asks where with the save dialog the shell opens (never a path the window names) and writes
/// `text` there. The path written, or `None` when the user cancelled.
pub(crate) async fn save_as<R: Runtime>(
    app: &AppHandle<R>,
    state: &AppState,
    name: String,
    label: &str,
    ext: &str,
    text: &str,
) -> AppResult<Option<String>> {
    let chosen = match &state.save_dialog {
        Some(dialog) => dialog(name).await,
        None => {
            let (tx, rx) = tokio::sync::oneshot::channel();
            app.dialog().file().set_file_name(name).add_filter(label, &[ext]).save_file(move |path| {
                let _ = tx.send(path.and_then(|p| p.into_path().ok()));
            });
            rx.await.ok().flatten()
        }
    };
    let Some(path) = chosen else { return Ok(None) };
    std::fs::write(&path, text)
        .map_err(|e| AppError::new(ErrorKind::Io, format!("{}: cannot write the export: {e}", path.display())))?;
    Ok(Some(path.display().to_string()))
}

pub async fn export_text(store: &baton_store::Store, target: ExportTarget, format: ExportFormat) -> AppResult<String> {
    let pretty = |v: &serde_json::Value| serde_json::to_string_pretty(v).unwrap_or_default();
    match target {
        ExportTarget::Run(id) => {
            let tree = store
                .run(id)
                .await?
                .ok_or_else(|| AppError::not_found(format!("there is no run {id} in the history")))?;
            Ok(match format {
                ExportFormat::Markdown => export::run_markdown(&tree),
                ExportFormat::Json => pretty(&export::run_json(&tree)),
            })
        }
        ExportTarget::Conversation(id) => {
            let title = store
                .conversation_title(id)
                .await?
                .ok_or_else(|| AppError::not_found(format!("there is no conversation {id} in the history")))?;
            let mut trees = Vec::new();
            for run in store.conversation_runs(id).await? {
                trees.extend(store.run(run.id).await?);
            }
            Ok(match format {
                ExportFormat::Markdown => export::conversation_markdown(&title, &trees),
                ExportFormat::Json => {
                    pretty(&export::conversation_json(id, &title, &store.messages(id).await?, &trees))
                }
            })
        }
    }
}
