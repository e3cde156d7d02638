//! The app on Tauri's mock runtime, for the command tests: the real configuration and
//! capabilities, state over files in a temporary directory, and commands called through IPC.

#![allow(dead_code)] // Each test binary uses part of it.

use std::path::Path;

use baton_desktop::{AppState, Paths};
use serde_json::{Value, json};
use tauri::ipc::{CallbackFn, InvokeBody};
use tauri::test::{INVOKE_KEY, MockRuntime, get_ipc_response, mock_builder};
use tauri::{App, WebviewWindow, WebviewWindowBuilder};

pub struct Harness {
    _app: App<MockRuntime>,
    pub window: WebviewWindow<MockRuntime>,
}

impl Harness {
    /// What the app keeps between commands (to look at the models it holds).
    pub fn state(&self) -> tauri::State<'_, AppState> {
        tauri::Manager::state::<AppState>(&self._app)
    }
}

/// The app over files in `dir`. There is no user to answer the save dialog: it answers
/// `dir/saved/<the name it suggests>`.
pub fn app(dir: &Path, label: &str) -> Harness {
    let paths = Paths { pool: dir.join("pool.toml"), db: dir.join("history.sqlite"), models: dir.join("models") };
    let saved = dir.join("saved");
    std::fs::create_dir_all(&saved).unwrap();
    let dialog: baton_desktop::state::SaveDialog = std::sync::Arc::new(move |name: String| {
        let path = saved.join(name);
        Box::pin(async move { Some(path) })
    });
    let state = AppState::new(paths).with_save_dialog(dialog);
    let app = baton_desktop::builder(mock_builder(), state).build(baton_desktop::context()).unwrap();
    let window = WebviewWindowBuilder::new(&app, label, Default::default()).build().unwrap();
    Harness { _app: app, window }
}

pub fn invoke(h: &Harness, cmd: &str, args: Value) -> Result<Value, Value> {
    invoke_in(&h.window, cmd, args)
}

pub fn invoke_in(window: &WebviewWindow<MockRuntime>, cmd: &str, args: Value) -> Result<Value, Value> {
    get_ipc_response(
        window,
        tauri::webview::InvokeRequest {
            cmd: cmd.into(),
            callback: CallbackFn(0),
            error: CallbackFn(1),
            url: "tauri://localhost".parse().unwrap(),
            body: InvokeBody::Json(args),
            headers: Default::default(),
            invoke_key: INVOKE_KEY.to_string(),
        },
    )
    .map(|body| body.deserialize::<Value>().unwrap())
}

pub fn worker(name: &str, model: &str, base_url: &str) -> Value {
    json!({
        "original": null, "name": name, "provider": "openai-compatible", "model": model,
        "base_url": base_url, "api_key_env": null, "max_tokens": null, "temperature": null,
        "reasoning_effort": null, "thinking_budget": null, "price_in": 0.0, "price_out": 0.0, "price_cached_in": null,
        "description": format!("{name} worker"),
    })
}

pub fn conductor() -> Value {
    json!({
        "model": null, "url": null, "grammar": null, "device": "auto", "max_steps": 5, "recursion": false,
        "max_depth": 2, "max_calls": null, "max_tokens": null, "max_cost_usd": null,
    })
}
