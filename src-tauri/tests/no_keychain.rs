//! The keys screen on a machine without a keychain: the commands say what is missing and what to
//! install, and nothing is stored anywhere else. A test binary of its own, because it points the
//! whole process at a D-Bus session bus that does not exist.

#[path = "support/harness.rs"]
mod harness;

use harness::{app, invoke};
use serde_json::json;

#[test]
fn without_a_keychain_the_keys_screen_says_what_to_install() {
    // SAFETY: the only test in this binary, and it sets the variable before the app (and any
    // thread that could read the environment) exists.
    #[allow(unsafe_code)]
    unsafe {
        std::env::set_var("DBUS_SESSION_BUS_ADDRESS", "unix:path=/nonexistent/baton-test-bus");
    }
    let dir = tempfile::tempdir().unwrap();
    let h = app(dir.path(), "main");

    let view = invoke(&h, "list_keys", json!({})).unwrap();
    let message = view["keychain_error"].as_str().expect("an explanation, not an error page");
    for needle in ["no OS keychain is available", "apt install gnome-keyring", "KeePassXC", "api_key_env"] {
        assert!(message.contains(needle), "{needle}: {message}");
    }
    // The hosted providers are still listed, so the screen can show where keys would go.
    let accounts: Vec<&str> = view["keys"].as_array().unwrap().iter().map(|k| k["account"].as_str().unwrap()).collect();
    assert_eq!(accounts, ["openai", "anthropic", "gemini"]);
    assert!(view["keys"].as_array().unwrap().iter().all(|k| k["stored"] == false));

    let key = "sk-never-stored-0123456789";
    let err = invoke(&h, "set_key", json!({ "provider": "openai", "baseUrl": null, "key": key })).unwrap_err();
    assert_eq!(err["kind"], "keychain", "{err}");
    let message = err["message"].as_str().unwrap();
    assert!(message.contains("apt install gnome-keyring") && !message.contains(key), "{message}");
    // Nothing fell back to a file.
    for entry in std::fs::read_dir(dir.path()).unwrap() {
        let path = entry.unwrap().path();
        if path.is_file() {
            assert!(!std::fs::read(&path).unwrap().windows(key.len()).any(|w| w == key.as_bytes()), "{path:?}");
        }
    }
}
