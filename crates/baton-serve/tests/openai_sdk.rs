//! `baton serve` through the official `openai` Python package (openai_sdk.py): the server over
//! loopback workers, the SDK as a client would use it. `scripts/test` makes the package's
//! virtual environment and names its Python in `BATON_OPENAI_PYTHON`; without it the test is
//! skipped, except in CI, where it fails.

use std::sync::Arc;
use std::time::Duration;

use baton_conductor::{ConductorOptions, RemoteConductor};
use baton_engine::{Executor, Pool};
use baton_providers::{ApiKey, HttpModel, ModelSettings, ProviderKind};
use baton_serve::{ServeOptions, Service};
use baton_store::{RunStatus, Store};
use baton_testserver::{TestServer, Wire};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

const PLAN: &str = "```python\nmodel_id = [0, 0]\nsubtasks = [\"Draft an answer.\", \"Improve the draft.\"]\naccess_list = [[], \"all\"]\n```";

#[tokio::test(flavor = "multi_thread")]
async fn the_official_openai_package_lists_asks_streams_and_gets_each_error_class() {
    let Some(python) = std::env::var_os("BATON_OPENAI_PYTHON") else {
        assert!(std::env::var_os("CI").is_none(), "BATON_OPENAI_PYTHON is unset: run the tests through scripts/test");
        eprintln!("skipped: BATON_OPENAI_PYTHON is unset (scripts/test sets it)");
        return;
    };
    let providers = TestServer::start().await.expect("providers");
    let mut text = "[retry]\nmax_retries = 0\n".to_owned();
    for (name, model) in [("fast", "fast"), ("slow", "slow;lines=60;latency=10000")] {
        text.push_str(&format!(
            "\n[[worker]]\nname = \"{name}\"\nprovider = \"openai\"\nmodel = \"{model}\"\nbase_url = \"{}\"\n",
            providers.base_url(Wire::OpenAi)
        ));
    }
    let pool = Pool::parse(&text, "pool.toml").expect("pool");
    providers.queue_replies("planner", [PLAN; 5]);
    let http = HttpModel::new(
        ProviderKind::OpenAiCompatible,
        &providers.base_url(Wire::OpenAi),
        ModelSettings::new("planner"),
        Arc::new(|| Ok(None)),
        HttpModel::http_client(),
    );
    let conductor = RemoteConductor::new(Arc::new(http), "planner".into(), pool.infos(), &ConductorOptions::default());
    let executor = Executor::from_pool_with_keys(&pool, |_| Arc::new(|| Ok(Some(ApiKey::new("sk-canary-sdk")))))
        .with_planner(Arc::new(conductor));
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(&dir.path().join("history.sqlite")).await.expect("history");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().unwrap().port();
    let options = ServeOptions { port, token: Some("sdk-token".into()), ..ServeOptions::default() };
    let service = Service::new(Arc::new(executor), true, Some(store.clone()), options).expect("service");
    let shutdown = CancellationToken::new();
    tokio::spawn(baton_serve::serve(listener, Arc::new(service), shutdown.clone()));

    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_sdk.py");
    let out = tokio::process::Command::new(python)
        .args([script, &format!("http://127.0.0.1:{port}/v1"), "sdk-token"])
        .output()
        .await
        .expect("python runs");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(!stdout.contains("sk-canary-sdk") && !stderr.contains("sk-canary-sdk"));
    let facts: Value = serde_json::from_str(stdout.lines().last().expect("facts")).expect("json");

    // The run the client hung up on is cancelled in the history.
    let uid = facts["hung_up_on"].as_str().expect("the script hung up on a run");
    let mut status = None;
    for _ in 0..100 {
        let runs = store.list_runs(20, None).await.unwrap();
        for summary in runs {
            let tree = store.run(summary.id).await.unwrap().unwrap();
            if tree.run.uid == uid {
                status = Some(summary.status);
            }
        }
        if status == Some(RunStatus::Cancelled) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(status, Some(RunStatus::Cancelled), "{facts}");
    shutdown.cancel();
}
