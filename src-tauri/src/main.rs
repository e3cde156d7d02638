// No console window next to the app on Windows release builds.
#![cfg_attr(not(debug_assertions), windows_subsystem = "windows")]

fn main() {
    keep_model_caches_in_baton_data_dir();
    baton_desktop::run();
}

/// mistral.rs creates a Hugging Face cache directory even for local models; point it at Baton's
/// own data directory so nothing is written to the user's home cache, and never go online.
fn keep_model_caches_in_baton_data_dir() {
    let dir = dirs::data_dir().unwrap_or_else(std::env::temp_dir).join("baton").join("hf");
    // SAFETY: called first thing in main, before the async runtime, the webview or any other
    // thread exists, so nothing can read the environment concurrently.
    #[allow(unsafe_code)]
    unsafe {
        std::env::set_var("HF_HOME", &dir);
        std::env::set_var("HF_HUB_OFFLINE", "1");
    }
}
