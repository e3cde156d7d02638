// No console window next to the app on Windows release builds.
#![cfg_attr(not(debug_assertions), windows_subsystem = "windows")]

baton_local::check_cpu_before_anything!();

fn main() {
    // Before anything else: the rest of the binary may use instructions this CPU lacks.
    baton_local::cpu::exit_unless_supported();
    // SAFETY: first thing in main: no other thread (async runtime, webview) exists yet.
    #[allow(unsafe_code)]
    unsafe {
        baton_local::set_engine_environment();
    }
    baton_desktop::run();
}
