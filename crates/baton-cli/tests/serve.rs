//! `baton serve` as a user starts it: the binary, a pool file, a remote conductor and a worker
//! behind loopback servers, and a client over HTTP.

use std::path::Path;
use std::time::Duration;

use baton_tests::{Output, TEST_KEY, W, private_keychain, write_pool};
use baton_testserver::{Options, TestServer, Wire};
use serde_json::{Value, json};

const BIN: &str = env!("CARGO_BIN_EXE_baton");

async fn baton(args: &[&str], env: &[(&str, Option<&str>)]) -> Output {
    baton_tests::run_with(Path::new(BIN), args, None, env).await
}

#[tokio::test(flavor = "multi_thread")]
async fn an_open_bind_without_a_token_is_refused_before_anything_loads() {
    let out = baton(&["serve", "--host", "0.0.0.0", "--no-token", "--pool", "/nonexistent/pool.toml"], &[]).await;
    assert_eq!(out.code, Some(2), "{}", out.stderr);
    assert!(out.stderr.contains("--no-token") && out.stderr.contains("--token-env"), "{}", out.stderr);
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = dir.path().join("pool.toml");
    std::fs::write(&pool, "[[worker]]\nname = \"a\"\nprovider = \"openai\"\nmodel = \"m\"\n").expect("pool");
    let pool = pool.to_str().unwrap();
    let out = baton(&["serve", "--token-env", "BATON_SERVE_TEST_UNSET", "--pool", pool, "--no-history"], &[]).await;
    assert_eq!(out.code, Some(2), "{}", out.stderr);
    assert!(out.stderr.contains("BATON_SERVE_TEST_UNSET"), "{}", out.stderr);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_token_is_made_once_and_kept_in_the_keychain() {
    if !private_keychain() {
        return;
    }
    let first = baton(&["serve", "token"], &[]).await;
    assert_eq!(first.code, Some(0), "{}", first.stderr);
    let token = first.stdout.trim().to_owned();
    assert!(token.len() == 64 && token.chars().all(|c| c.is_ascii_hexdigit()), "{token}");
    assert_eq!(baton(&["serve", "token"], &[]).await.stdout.trim(), token);
    let renewed = baton(&["serve", "token", "--new"], &[]).await;
    assert_eq!(renewed.code, Some(0), "{}", renewed.stderr);
    assert_ne!(renewed.stdout.trim(), token);
    assert_eq!(baton(&["serve", "token"], &[]).await.stdout.trim(), renewed.stdout.trim());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_served_pool_answers_an_openai_client_and_records_the_run() {
    let s = TestServer::start_with(Options { key: Some(TEST_KEY.into()), ..Options::default() }).await.expect("server");
    let dir = tempfile::tempdir().expect("tempdir");
    let conductor = format!(
        "[conductor]\nurl = \"{}\"\nmodel = \"planner\"\napi_key_env = \"BATON_E2E_KEY\"\n",
        s.base_url(Wire::OpenAi)
    );
    let pool = write_pool(dir.path(), &s, &conductor, &[W("a", "openai", "alpha"), W("b", "anthropic", "beta")]);
    let db = dir.path().join("history.sqlite");
    s.queue_replies(
        "planner",
        ["```python\nmodel_id = [0, 1]\nsubtasks = [\"Draft.\", \"Improve it.\"]\naccess_list = [[], \"all\"]\n```"],
    );
    let (pool, db) = (pool.to_str().expect("utf-8"), db.to_str().expect("utf-8"));
    let logs = dir.path().join("logs");
    let env = [
        ("BATON_SERVE_TEST_TOKEN", "tok-123"),
        ("BATON_E2E_KEY", TEST_KEY),
        ("BATON_LOG_DIR", logs.to_str().expect("utf-8")),
    ];
    let args = ["--port", "0", "--token-env", "BATON_SERVE_TEST_TOKEN", "--pool", pool, "--db", db];
    let server = baton_tests::serve(Path::new(BIN), &args, &env, Duration::from_secs(30)).await;
    let url = server.url.clone();
    assert!(url.starts_with("http://127.0.0.1:") && url.ends_with("/v1"), "{url}");

    let client = reqwest::Client::new();
    let models: Value =
        client.get(format!("{url}/models")).bearer_auth("tok-123").send().await.unwrap().json().await.unwrap();
    let ids: Vec<&str> = models["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["baton", "baton/a", "baton/b"]);
    let r = client
        .post(format!("{url}/chat/completions"))
        .bearer_auth("tok-123")
        .json(&json!({ "model": "baton", "messages": [{ "role": "user", "content": "What is a conductor?" }] }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let run_id = r.headers()["x-baton-run-id"].to_str().unwrap().to_owned();
    let body: Value = r.json().await.unwrap();
    assert!(!body["choices"][0]["message"]["content"].as_str().unwrap().is_empty(), "{body}");
    let wrong = client.get(format!("{url}/models")).bearer_auth("tok-124").send().await.unwrap();
    assert_eq!(wrong.status(), 401);

    // Ctrl-C stops it cleanly; the run is in the history, as any other.
    let status = server.interrupt().await;
    assert!(status.success(), "{status:?}");
    let listed = baton(&["history", "list", "--json", "--db", db], &[]).await;
    let run: Value = serde_json::from_str(listed.stdout.lines().next().expect("a run")).unwrap();
    let shown = baton(&["history", "show", &run["id"].to_string(), "--json", "--db", db], &[]).await;
    let tree: Value = serde_json::from_str(&shown.stdout).unwrap();
    assert_eq!(tree["run"]["uid"], run_id.as_str());
    assert_eq!(tree["run"]["status"], "finished");
    assert!(!shown.stdout.contains(TEST_KEY), "no key in the history");
}

/// The load test: 64 streamed requests at once, three times (on new connections, then twice on
/// the open ones). Every one must be answered and every run recorded as finished; the timings are for people
/// (`baton bench serve`), not asserted.
#[tokio::test(flavor = "multi_thread")]
async fn sixty_four_streamed_requests_at_once_are_all_answered_and_recorded() {
    let out =
        baton(&["bench", "serve", "--requests", "64", "--bursts", "2", "--latency-ms", "50", "--json"], &[]).await;
    assert_eq!(out.code, Some(0), "{}\n{}", out.stdout, out.stderr);
    let report: Value = serde_json::from_str(out.stdout.trim()).expect("one JSON object");
    assert_eq!(report["errors"], json!([]), "{report}");
    assert_eq!(report["ok"], 128, "{report}");
    assert_eq!(report["new_connections"]["ok"], 64, "{report}");
    assert_eq!(report["recorded_finished"], 192, "{report}");
    assert!(report["overhead_ms_p50"].as_f64().is_some_and(f64::is_finite), "{report}");
}
