//! The webview is untrusted: what a script running there could try through IPC, played step by
//! step on the mock runtime with the real capabilities, the real keychain (the throwaway one
//! `scripts/test` starts) and a loopback server standing in for the attacker's. Each step is
//! refused, or goes out without a key.

#[path = "support/harness.rs"]
mod harness;

use harness::{app, conductor, invoke};
use serde_json::{Value, json};

const CANARY: &str = "sk-canary-0123456789-must-stay-with-api.openai.com";

/// The pool as the user wrote it: an OpenAI worker on its official host (key in the keychain),
/// and a server of their own whose key comes from an environment variable (`PATH` stands in for
/// a secret one: it is always set).
fn users_pool(dir: &std::path::Path) {
    std::fs::write(
        dir.join("pool.toml"),
        "[[worker]]\nname = \"gpt\"\nprovider = \"openai\"\nmodel = \"gpt-5\"\n\n\
         [[worker]]\nname = \"mine\"\nprovider = \"openai-compatible\"\nmodel = \"m\"\n\
         base_url = \"http://127.0.0.1:9/v1\"\napi_key_env = \"PATH\"\n",
    )
    .unwrap();
}

fn form(h: &harness::Harness) -> Value {
    invoke(h, "get_settings", json!({})).unwrap()["form"].clone()
}

#[test]
fn a_script_in_the_window_cannot_send_a_key_elsewhere_or_write_where_it_likes() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let attacker = rt.block_on(baton_testserver::TestServer::start()).unwrap();
    let evil = attacker.base_url(baton_testserver::Wire::OpenAi);
    let dir = tempfile::tempdir().unwrap();
    users_pool(dir.path());
    let h = app(dir.path(), "main");
    let pool_before = std::fs::read_to_string(dir.path().join("pool.toml")).unwrap();

    // 1. Name an environment variable as a worker's key: refused, the file is untouched.
    let mut f = form(&h);
    f["workers"][0]["api_key_env"] = json!("AWS_SECRET_ACCESS_KEY");
    let err = invoke(&h, "save_settings", json!({ "form": f })).unwrap_err();
    assert_eq!(err["kind"], "bad_input", "{err}");
    assert!(err["message"].as_str().unwrap().contains("only be set in the pool file"), "{err}");
    let mut f = form(&h);
    f["workers"].as_array_mut().unwrap().push(json!({
        "original": null, "name": "new", "provider": "openai-compatible", "model": "m", "base_url": evil,
        "api_key_env": "AWS_SECRET_ACCESS_KEY", "max_tokens": null, "temperature": null, "reasoning_effort": null,
        "thinking_budget": null, "price_in": 0.0, "price_out": 0.0, "price_cached_in": null, "description": null,
    }));
    assert_eq!(invoke(&h, "save_settings", json!({ "form": f })).unwrap_err()["kind"], "bad_input");

    // 2. Move the worker whose key comes from the environment to the attacker's server: refused.
    let mut f = form(&h);
    f["workers"][1]["base_url"] = json!(evil);
    let err = invoke(&h, "save_settings", json!({ "form": f })).unwrap_err();
    assert!(err["message"].as_str().unwrap().contains("environment variable PATH"), "{err}");
    assert_eq!(std::fs::read_to_string(dir.path().join("pool.toml")).unwrap(), pool_before);

    // 3. Point the OpenAI worker at the attacker's server (allowed: a URL alone is no secret),
    //    store a key for OpenAI, and test the worker: the key is OpenAI's, not the new host's.
    let mut f = form(&h);
    f["workers"][0]["base_url"] = json!(evil);
    invoke(&h, "save_settings", json!({ "form": f })).unwrap();
    let keychain = baton_tests::private_keychain();
    if keychain {
        invoke(&h, "set_key", json!({ "provider": "openai", "baseUrl": null, "key": CANARY })).unwrap();
    }
    let tested = invoke(&h, "test_worker", json!({ "index": 0, "stopId": "test-1" }));
    let err = tested.expect_err("there is no key for the attacker's host");
    assert_eq!(err["kind"], "provider", "{err}");
    if keychain {
        assert!(err["message"].as_str().unwrap().contains("openai:"), "names the entry that would hold one: {err}");
    }
    for request in attacker.requests() {
        let headers = format!("{:?}", request.headers);
        assert!(!headers.contains(CANARY), "the OpenAI key reached another host: {headers}");
    }
    // The entry the app lists for the worker is the new host's, empty.
    let keys = invoke(&h, "list_keys", json!({})).unwrap();
    let row = keys["keys"].as_array().unwrap().iter().find(|r| r["used_by"] == json!(["gpt"])).unwrap().clone();
    assert_eq!(row["account"], json!(format!("openai:{}", evil.trim_end_matches('/'))), "{row}");
    assert_eq!(row["stored"], false, "{row}");
    if keychain {
        invoke(&h, "delete_key", json!({ "provider": "openai", "baseUrl": null })).unwrap();
    }

    // 4. Allow a variable to go where the pool sends none: refused, whatever the variable. The
    //    pool's own pairing (PATH to the user's server) stops every run until the user allows
    //    it; the error names both for the dialog that asks.
    let evil_origin = baton_secrets::origin(&evil).unwrap();
    for var in ["AWS_SECRET_ACCESS_KEY", "PATH"] {
        let err = invoke(&h, "allow_env_key", json!({ "var": var, "origin": evil_origin })).unwrap_err();
        assert_eq!(err["kind"], "bad_input", "{err}");
    }
    let plan = json!({ "model_id": [0], "subtasks": ["x"], "access_list": [[]] });
    let request = json!({ "question": "q", "conversation_id": null, "workers": null, "plan": plan });
    let asked = |id: &str| invoke(&h, "ask", json!({ "request": request, "stopId": id, "onEvent": "__CHANNEL__:1" }));
    let err = asked("consent-1").unwrap_err();
    assert_eq!(err["kind"], "key_not_allowed", "{err}");
    assert_eq!(err["consent"], json!({ "var": "PATH", "origin": "http://127.0.0.1:9", "owner": "worker \"mine\"" }));
    if keychain {
        invoke(&h, "allow_env_key", json!({ "var": "PATH", "origin": "http://127.0.0.1:9" })).unwrap();
        asked("consent-2").expect("allowed, the run goes ahead");
    }

    // 5. Export the history over the user's SSH keys: the window cannot name a path; the export
    //    goes only where the save dialog (the user) said.
    let plan = json!({ "model_id": [0], "subtasks": ["x"], "access_list": [[]] });
    let mut f = form(&h);
    f["workers"][0] = harness::worker("w", "w;reply=ok", &evil);
    f["workers"].as_array_mut().unwrap().truncate(1);
    f["conductor"] = conductor();
    // The first worker is replaced by a keyless server: no environment variable moves.
    f["workers"][0]["original"] = Value::Null;
    invoke(&h, "save_settings", json!({ "form": f })).unwrap();
    let request = json!({ "question": "q", "conversation_id": null, "workers": null, "plan": plan });
    let run = invoke(&h, "ask", json!({ "request": request, "stopId": "r", "onEvent": "__CHANNEL__:1" })).unwrap();
    let ssh = dir.path().join(".ssh");
    std::fs::create_dir_all(&ssh).unwrap();
    let target = ssh.join("authorized_keys");
    let args = json!({ "target": { "kind": "run", "id": run["run_id"] }, "format": "markdown", "path": target });
    let written = invoke(&h, "export_history", args).unwrap();
    assert!(!target.exists(), "the window named a path and the app wrote there");
    assert!(written.as_str().unwrap().starts_with(&dir.path().join("saved").display().to_string()), "{written}");
}
