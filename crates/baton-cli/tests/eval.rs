//! `baton eval` against loopback workers scripted so the truth is known: worker `a` knows the
//! number items, `b` the choice items, `c` nothing; the conductor sends numbers to `a`, choices
//! to `b`, except the "hard" choice items, which it sends to `c`. Every figure the evaluation
//! reports is checked against that truth and against the server's own request log.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::Duration;

use baton_tests::{Output, TEST_KEY, arg as path};
use baton_testserver::{Options, TestServer, Wire};
use serde_json::Value;

async fn baton(args: &[&str]) -> Output {
    baton_tests::run_suite(Path::new(env!("CARGO_BIN_EXE_baton")), args).await
}

/// $1 per million input tokens, $2 per million output tokens.
const PRICE_IN: f64 = 1.0;
const PRICE_OUT: f64 = 2.0;

struct Setup {
    dir: tempfile::TempDir,
    suite: PathBuf,
    pool: PathBuf,
    db: PathBuf,
    /// Items by id: (category, hard).
    items: BTreeMap<String, (String, bool)>,
}

impl Setup {
    /// `baton eval run` on this setup's suite, pool and history, with `more` arguments.
    async fn eval_run(&self, more: &[&str]) -> Output {
        let mut args = vec!["eval", "run", path(&self.suite), "--pool", path(&self.pool), "--db", path(&self.db)];
        args.extend_from_slice(more);
        baton(&args).await
    }
}

/// 8 number items and 8 choice items (3 of them "hard"), the workers' and the conductor's
/// knowledge, and a pool on `server`. `extra` goes into each worker's model string.
fn setup(server: &TestServer, extra: &str, worker_toml: &str) -> Setup {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut suite = String::new();
    let (mut a, mut b, mut plans) = (serde_json::Map::new(), serde_json::Map::new(), serde_json::Map::new());
    let mut items = BTreeMap::new();
    let plan = |worker: usize, needle: &str| {
        format!(
            "Route it.\n```python\nmodel_id = [{worker}]\nsubtasks = [\"Answer {needle} carefully.\"]\naccess_list = [[]]\n```"
        )
    };
    for i in 0..8 {
        let needle = format!("<N{i}>");
        let answer = 40 + i;
        suite.push_str(&format!(
            "{{\"id\": \"n{i}\", \"kind\": \"number\", \"category\": \"arithmetic\", \"question\": \"{needle} What is {i} + 40?\", \"answer\": \"{answer}\"}}\n"
        ));
        a.insert(needle.clone(), format!("{i} plus 40 is {answer}.\n#### {answer}").into());
        plans.insert(needle.clone(), plan(0, &needle).into());
        items.insert(format!("n{i}"), ("arithmetic".to_owned(), false));
    }
    for i in 0..8 {
        let needle = format!("<C{i}>");
        let letter = ["A", "B", "C", "D"][i % 4];
        let hard = i >= 5;
        suite.push_str(&format!(
            "{{\"id\": \"c{i}\", \"kind\": \"choice\", \"category\": \"trivia\", \"question\": \"{needle} Which one?\\n\\nA. w\\nB. x\\nC. y\\nD. z\", \"answer\": \"{letter}\"}}\n"
        ));
        b.insert(needle.clone(), format!("It is the one.\nAnswer: {letter}").into());
        plans.insert(needle.clone(), plan(if hard { 2 } else { 1 }, &needle).into());
        items.insert(format!("c{i}"), ("trivia".to_owned(), hard));
    }
    let write = |name: &str, text: String| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).expect("write");
        p
    };
    let suite_path = write("suite.jsonl", suite);
    let know_a = write("a.json", Value::Object(a).to_string());
    let know_b = write("b.json", Value::Object(b).to_string());
    let know_plans = write("plans.json", Value::Object(plans).to_string());
    let url = server.base_url(Wire::OpenAi);
    let mut pool = format!(
        "[conductor]\nurl = \"{url}\"\nmodel = \"cond;knows={}\"\napi_key_env = \"BATON_E2E_KEY\"\n\n[retry]\ninitial_delay_ms = 10\nmax_delay_ms = 100\n",
        path(&know_plans)
    );
    for (name, model) in [
        ("a", format!("a;knows={};reply=No_idea.{extra}", path(&know_a))),
        ("b", format!("b;knows={};reply=No_idea.{extra}", path(&know_b))),
        ("c", format!("c;reply=No_idea.{extra}")),
    ] {
        pool.push_str(&format!(
            "\n[[worker]]\nname = \"{name}\"\nprovider = \"openai-compatible\"\nmodel = \"{model}\"\nbase_url = \"{url}\"\napi_key_env = \"BATON_E2E_KEY\"\nprice_in = {PRICE_IN}\nprice_out = {PRICE_OUT}\n{worker_toml}"
        ));
    }
    let pool_path = write("pool.toml", pool);
    let db = dir.path().join("history.sqlite");
    Setup { suite: suite_path, pool: pool_path, db, items, dir }
}

async fn server() -> TestServer {
    TestServer::start_with(Options { key: Some(TEST_KEY.into()), ..Options::default() }).await.expect("server")
}

fn results(setup: &Setup, id: &str) -> Vec<Value> {
    let out = setup.dir.path().join("export");
    let file = out.join(format!("{id}.results.jsonl"));
    let _ = std::fs::remove_file(&file);
    let text = std::process::Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["eval", "export", id, "-o", path(&out), "--db", path(&setup.db)])
        .output()
        .expect("export");
    assert!(text.status.success(), "{}", String::from_utf8_lossy(&text.stderr));
    std::fs::read_to_string(&file).expect("results").lines().map(|l| serde_json::from_str(l).expect("json")).collect()
}

/// The dollars the server's log says worker requests cost.
fn billed(server: &TestServer) -> f64 {
    server
        .requests()
        .iter()
        .filter(|r| !r.model.starts_with("cond"))
        .map(|r| {
            let u = r.reported();
            (u.input_tokens as f64 * PRICE_IN + u.output_tokens as f64 * PRICE_OUT) / 1e6
        })
        .sum()
}

#[tokio::test(flavor = "multi_thread")]
async fn every_strategy_scores_exactly_what_the_scripted_workers_know() {
    let s = server().await;
    let setup = setup(&s, "", "");
    let strategies = "conductor,all-singles,moa,router:lookup,router:random,best-of-n:b:3,oracle";
    let out = setup.eval_run(&["--strategies", strategies, "--calibration", "0.5", "--id", "truth", "--json"]).await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let report: Value = serde_json::from_str(out.stdout.lines().last().expect("a JSON line")).expect("json");
    assert_eq!(report["id"], "truth");
    let by: HashMap<&str, &Value> =
        report["strategies"].as_array().unwrap().iter().map(|s| (s["strategy"].as_str().unwrap(), s)).collect();
    let rows = results(&setup, "truth");

    // The test split: half of each category, drawn by the seed.
    let test: Vec<&str> = {
        let mut t: Vec<&str> = rows
            .iter()
            .filter(|r| r["strategy"] == "single:a" && r["split"] == "test")
            .map(|r| r["item_id"].as_str().unwrap())
            .collect();
        t.sort_unstable();
        t
    };
    assert_eq!(test.len(), 8, "4 of each category are kept for calibration");
    let numbers = test.iter().filter(|i| i.starts_with('n')).count();
    assert_eq!(numbers, 4);
    let hard_in_test = test.iter().filter(|i| setup.items[**i].1).count();
    let acc = |name: &str| by[name]["accuracy"].as_f64().unwrap();
    assert_eq!(acc("single:a"), 0.5);
    assert_eq!(acc("single:b"), 0.5);
    assert_eq!(acc("single:c"), 0.0);
    assert_eq!(acc("conductor"), (8 - hard_in_test) as f64 / 8.0, "the hard choices went to c");
    assert_eq!(acc("router:lookup"), 1.0, "numbers to a, choices to b");
    assert_eq!(acc("oracle"), 1.0);
    // MoA: a (best on calibration, first in the pool on a tie) aggregates; it knows numbers only.
    assert_eq!(acc("moa"), 0.5);
    assert_eq!(acc("best-of-n:b"), 0.5);
    for name in ["conductor", "single:a", "moa", "router:lookup", "oracle", "best-of-n:b"] {
        assert_eq!(by[name]["n"], 8, "{name} is scored on the test split only");
    }
    let config = &report["config"];
    assert_eq!(config["lookup"]["arithmetic"], "a");
    assert_eq!(config["lookup"]["trivia"], "b");
    assert_eq!(config["moa_aggregator"], "a");
    assert_eq!(config["best_of_n"]["b"], 3);
    assert_eq!(by["conductor"]["plan_validity"], 1.0);
    assert_eq!(by["best-of-n:b"]["figures"]["calls"], 8 * 3);
    assert_eq!(by["moa"]["figures"]["calls"], 8 * 4);

    // Derived strategies take exactly one worker's result per item (the oracle pays for all).
    let single: HashMap<(String, String), &Value> = rows
        .iter()
        .filter(|r| r["strategy"].as_str().unwrap().starts_with("single:"))
        .map(|r| ((r["strategy"].as_str().unwrap().to_owned(), r["item_id"].as_str().unwrap().to_owned()), r))
        .collect();
    for r in rows.iter().filter(|r| r["strategy"] == "router:random") {
        let item = r["item_id"].as_str().unwrap();
        assert!(
            ["a", "b", "c"]
                .iter()
                .any(|w| single[&(format!("single:{w}"), item.to_owned())]["run_uid"] == r["run_uid"]),
            "{r}"
        );
    }
    for r in rows.iter().filter(|r| r["strategy"] == "oracle") {
        let item = r["item_id"].as_str().unwrap();
        let sum: f64 = ["a", "b", "c"]
            .iter()
            .map(|w| single[&(format!("single:{w}"), item.to_owned())]["figures"]["cost_usd"].as_f64().unwrap())
            .sum();
        assert!((r["figures"]["cost_usd"].as_f64().unwrap() - sum).abs() < 1e-12);
    }

    // Costs: what the results say the workers cost is what the server's log bills.
    let recorded: f64 = rows
        .iter()
        .filter(|r| !matches!(r["strategy"].as_str().unwrap(), "oracle" | "router:lookup" | "router:random"))
        .map(|r| r["figures"]["cost_usd"].as_f64().unwrap())
        .sum();
    let log = billed(&s);
    assert!(log > 0.0);
    assert!((recorded - log).abs() < 1e-9, "results {recorded} vs server log {log}");
    assert!((report["spent_usd"].as_f64().unwrap() - log).abs() < 1e-9);
    // The remote conductor has no price: its cost is marked incomplete, not guessed.
    assert_eq!(by["conductor"]["figures"]["cost_complete"], false);

    // Paired comparisons: the conductor against the best single worker and the lookup router.
    let comparisons = report["comparisons"].as_array().unwrap();
    assert_eq!(comparisons.len(), 2);
    assert_eq!(comparisons[1]["b"], "router:lookup");
    assert_eq!(comparisons[1]["only_a"], 0);
    assert_eq!(comparisons[1]["only_b"], hard_in_test as u64);

    // Each result's run is in the history, kept out of the history's list and the chat's: the
    // evaluation lists them.
    let runs = baton(&["history", "list", "--db", path(&setup.db), "--json", "--limit", "1000"]).await;
    assert_eq!(runs.stdout.trim(), "", "{}", runs.stderr);
    let made: std::collections::HashSet<i64> = rows
        .iter()
        .filter(|r| !matches!(r["strategy"].as_str().unwrap(), "oracle" | "router:lookup" | "router:random"))
        .map(|r| r["run_id"].as_i64().expect("each run is in the history"))
        .collect();
    // Calibration: 8 items × 3 workers; test: conductor, 3 singles, MoA and best-of-n on 8 items.
    assert_eq!(made.len(), 8 * 3 + 8 * 6, "one run per result");
    let conversations = baton(&["history", "list", "--conversations", "--db", path(&setup.db), "--json"]).await;
    assert_eq!(conversations.stdout.trim(), "", "evaluation runs stay out of the chat's list");
    let first = rows.iter().find(|r| r["strategy"] == "conductor").unwrap();
    let shown = baton(&["history", "show", "--db", path(&setup.db), "--json", &first["run_id"].to_string()]).await;
    assert!(shown.stdout.contains("model_id"), "{}", shown.stdout);

    // The reports: table, Markdown with the chart, HTML.
    let table = baton(&["eval", "show", "truth", "--db", path(&setup.db)]).await;
    assert!(table.stdout.contains("router:lookup") && table.stdout.contains("McNemar"), "{}", table.stdout);
    let md = std::fs::read_to_string(setup.dir.path().join("export/truth.md")).unwrap();
    assert!(md.contains("![cost and accuracy](truth.svg)"));
    assert!(std::fs::read_to_string(setup.dir.path().join("export/truth.svg")).unwrap().starts_with("<svg"));

    // Running it again resumes a finished evaluation: no call is made.
    let before = s.requests().len();
    let again = setup.eval_run(&["--strategies", strategies, "--calibration", "0.5", "--id", "truth", "--json"]).await;
    assert_eq!(again.code, Some(0), "{}", again.stderr);
    assert_eq!(s.requests().len(), before);
    // Other settings under the same id are refused, before any call.
    let other = setup.eval_run(&["--strategies", "single:a", "--id", "truth"]).await;
    assert_eq!(other.code, Some(2));
    assert!(other.stderr.contains("was started with other settings"), "{}", other.stderr);
    assert_eq!(s.requests().len(), before);
}

/// Killed half way with `kill -9`, then run again: every result is there once, and the server
/// answered each (worker, item) once, except at most the one run in flight at the kill.
#[tokio::test(flavor = "multi_thread")]
async fn a_killed_evaluation_resumes_without_paying_twice() {
    let s = server().await;
    let setup = setup(&s, ";latency=150", "");
    let args = [
        "eval",
        "run",
        path(&setup.suite),
        "--pool",
        path(&setup.pool),
        "--db",
        path(&setup.db),
        "--strategies",
        "single:a,single:b",
        "--id",
        "resume",
        "--concurrency",
        "1",
        "--json",
    ];
    let mut child = baton_tests::spawn_quiet(Path::new(env!("CARGO_BIN_EXE_baton")), &args);
    let started = std::time::Instant::now();
    while s.requests().len() < 8 {
        assert!(started.elapsed() < Duration::from_secs(60), "too slow");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    child.start_kill().expect("kill -9");
    child.wait().await.expect("reaped");
    let at_kill = s.requests().len();
    let partial = results(&setup, "resume").len();
    assert!((7..=8).contains(&partial), "{partial} results kept");

    let out = baton(&args).await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let rows = results(&setup, "resume");
    assert_eq!(rows.len(), 32, "16 items × 2 workers");
    let mut asked: HashMap<(String, String), u32> = HashMap::new();
    for r in s.requests() {
        let last =
            r.body["messages"].as_array().and_then(|m| m.last()).map(|m| m["content"].to_string()).unwrap_or_default();
        let needle = last.split('>').next().unwrap_or_default().to_owned();
        *asked.entry((r.model.split(';').next().unwrap_or_default().to_owned(), needle)).or_default() += 1;
    }
    let twice: Vec<_> = asked.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.len() <= 1, "asked twice: {twice:?}");
    assert_eq!(s.requests().len(), 32 + twice.len(), "{at_kill} requests before the kill");
    let list = baton(&["eval", "list", "--db", path(&setup.db), "--json"]).await;
    let e: Value = serde_json::from_str(list.stdout.trim()).unwrap();
    assert_eq!((e["status"].as_str(), e["results"].as_i64()), (Some("finished"), Some(32)));
}

/// A spending cap stops the evaluation with what it has, never past the cap; a higher cap
/// goes on from there.
#[tokio::test(flavor = "multi_thread")]
async fn the_spending_cap_is_never_passed_and_a_higher_one_goes_on() {
    let s = server().await;
    // A small output cap keeps each call's worst case (what the cap must leave room for) small.
    let setup = setup(&s, "", "max_tokens = 64\n");
    let run = |cap: &'static str| {
        let (suite, pool, db) = (setup.suite.clone(), setup.pool.clone(), setup.db.clone());
        async move {
            baton(&[
                "eval",
                "run",
                path(&suite),
                "--pool",
                path(&pool),
                "--db",
                path(&db),
                "--strategies",
                "single:a",
                "--id",
                "cap",
                "--concurrency",
                "2",
                "--max-cost-usd",
                cap,
            ])
            .await
        }
    };
    let capped = run("0.001").await;
    assert_eq!(capped.code, Some(1), "{}", capped.stderr);
    assert!(capped.stderr.contains("the spending cap was reached"), "{}", capped.stderr);
    let spent = billed(&s);
    assert!(spent <= 0.001 + 1e-12, "spent {spent}");
    let kept = results(&setup, "cap").len();
    assert!(kept > 0 && kept < 16, "{kept}");
    let more = run("1").await;
    assert_eq!(more.code, Some(0), "{}", more.stderr);
    assert_eq!(results(&setup, "cap").len(), 16);
}

/// Code items run in the sandbox: a right function passes, a wrong one and a hostile one fail
/// without stopping the evaluation.
#[tokio::test(flavor = "multi_thread")]
async fn code_items_are_checked_in_the_sandbox() {
    let s = server().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let tests = "def check(candidate):\\n    assert candidate(2, 3) == 5\\n";
    let mut suite = String::new();
    let mut knows = serde_json::Map::new();
    let escaped = dir.path().join("escaped.txt");
    let replies = [
        ("<K0>", "```python\ndef add(a, b):\n    return a + b\n```".to_owned()),
        ("<K1>", "```python\ndef add(a, b):\n    return a - b\n```".to_owned()),
        (
            "<K2>",
            format!("```python\ndef add(a, b):\n    open({:?}, 'w').write('x')\n    return a + b\n```", path(&escaped)),
        ),
        ("<K3>", "```python\ndef add(a, b):\n    while True:\n        pass\n```".to_owned()),
    ];
    for (i, (needle, reply)) in replies.iter().enumerate() {
        suite.push_str(&format!(
            "{{\"id\": \"k{i}\", \"kind\": \"code\", \"question\": \"def add(a, b):\\n    \\\"\\\"\\\"{needle} Add.\\\"\\\"\\\"\\n\", \"entry_point\": \"add\", \"tests\": \"{tests}\"}}\n"
        ));
        knows.insert((*needle).to_owned(), reply.clone().into());
    }
    std::fs::write(dir.path().join("code.jsonl"), suite).unwrap();
    std::fs::write(dir.path().join("k.json"), Value::Object(knows).to_string()).unwrap();
    let url = s.base_url(Wire::OpenAi);
    let pool = format!(
        "[[worker]]\nname = \"coder\"\nprovider = \"openai-compatible\"\nmodel = \"coder;knows={}\"\nbase_url = \"{url}\"\napi_key_env = \"BATON_E2E_KEY\"\n",
        path(&dir.path().join("k.json"))
    );
    std::fs::write(dir.path().join("pool.toml"), pool).unwrap();
    let db = dir.path().join("h.sqlite");
    let out = baton(&[
        "eval",
        "run",
        path(&dir.path().join("code.jsonl")),
        "--pool",
        path(&dir.path().join("pool.toml")),
        "--db",
        path(&db),
        "--strategies",
        "single:coder",
        "--id",
        "code",
        "--json",
    ])
    .await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(out.stderr.contains("code runs in a sandbox"), "{}", out.stderr);
    let report: Value = serde_json::from_str(out.stdout.lines().last().unwrap()).unwrap();
    assert_eq!(report["strategies"][0]["accuracy"], 0.25);
    assert!(!escaped.exists(), "the write escaped the sandbox");
    let show = std::process::Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["eval", "export", "code", "-o", path(dir.path()), "--db", path(&db)])
        .output()
        .unwrap();
    assert!(show.status.success());
    let rows: Vec<Value> = std::fs::read_to_string(dir.path().join("code.results.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let error =
        |id: &str| rows.iter().find(|r| r["item_id"] == id).unwrap()["error"].as_str().unwrap_or_default().to_owned();
    assert!(error("k1").contains("AssertionError"), "{}", error("k1"));
    assert!(error("k2").contains("sandbox"), "{}", error("k2"));
    assert!(error("k3").contains("limit"), "{}", error("k3"));
}

/// Bad input is refused before any call, with what to do.
#[tokio::test(flavor = "multi_thread")]
async fn bad_suites_and_strategies_are_refused_before_any_call() {
    let s = server().await;
    let setup = setup(&s, "", "");
    let cases: [(&[&str], &str); 4] = [
        (&["eval", "run", "/no/such.jsonl", "--pool", path(&setup.pool)], "not a built-in suite"),
        (
            &["eval", "run", path(&setup.suite), "--pool", path(&setup.pool), "--strategies", "single:zed"],
            "no worker \"zed\"",
        ),
        (&["eval", "run", path(&setup.suite), "--pool", path(&setup.pool), "--strategies", "vote"], "unknown strategy"),
        (
            &[
                "eval",
                "run",
                path(&setup.suite),
                "--pool",
                path(&setup.pool),
                "--calibration",
                "0.95",
                "--strategies",
                "router:lookup",
            ],
            "--calibration",
        ),
    ];
    for (args, want) in cases {
        let mut args = args.to_vec();
        args.extend_from_slice(&["--db", path(&setup.db)]);
        let out = baton(&args).await;
        assert_eq!(out.code, Some(2), "{args:?}: {}", out.stderr);
        assert!(out.stderr.contains(want), "{args:?}: {}", out.stderr);
    }
    assert!(s.requests().is_empty());
    let suites = baton(&["eval", "suites"]).await;
    assert!(suites.stdout.contains("humaneval") && suites.stdout.contains("MIT"), "{}", suites.stdout);
}

/// `export-grpo`: one line per item, with the conductor's exact prompt as recorded with its plan
/// (no pool file needed), each sample's plan text and the paper's reward (1 right, 0.5 a usable
/// plan but wrong, 0 no usable plan).
#[tokio::test(flavor = "multi_thread")]
async fn conductor_samples_export_as_grpo_groups_with_the_papers_reward() {
    let s = server().await;
    let setup = setup(&s, "", "");
    let out = setup.eval_run(&["--strategies", "conductor", "--repeats", "2", "--id", "grpo"]).await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    // The prompts come from the history, as the conductor was asked them: the pool file may
    // have changed or be gone since.
    std::fs::remove_file(&setup.pool).expect("remove the pool file");
    let file = setup.dir.path().join("grpo.jsonl");
    let export =
        baton(&["eval", "export-grpo", "grpo", "-o", path(&file), "--db", path(&setup.db), "--samples", "2"]).await;
    assert_eq!(export.code, Some(0), "{}", export.stderr);
    let plans: Value =
        serde_json::from_str(&std::fs::read_to_string(setup.dir.path().join("plans.json")).unwrap()).unwrap();
    let groups: Vec<Value> =
        std::fs::read_to_string(&file).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(groups.len(), 16);
    // What the conductor was sent: the server's log holds each request's messages.
    let sent: Vec<Value> =
        s.requests().iter().filter(|r| r.model.starts_with("cond")).map(|r| r.body["messages"].clone()).collect();
    for g in &groups {
        let id = g["item_id"].as_str().unwrap();
        let (category, hard) = &setup.items[id];
        let needle = format!("<{}>", id.to_uppercase());
        assert_eq!(g["completions"].as_array().unwrap().len(), 2);
        for c in g["completions"].as_array().unwrap() {
            assert_eq!(c, &plans[&needle], "{id}");
        }
        let reward = if *hard { 0.5 } else { 1.0 };
        assert_eq!(g["rewards"], serde_json::json!([reward, reward]), "{id} ({category})");
        assert_eq!(g["kind"], if category == "arithmetic" { "number" } else { "choice" });
        assert!(sent.contains(&g["prompt"]), "{id}: the prompt is exactly what the conductor was sent");
    }
    // Asking for more samples than were drawn leaves every item out, and says so.
    let more =
        baton(&["eval", "export-grpo", "grpo", "-o", path(&file), "--db", path(&setup.db), "--samples", "3"]).await;
    assert!(more.stderr.contains("0 prompts written"), "{}", more.stderr);
}

/// A worker that refuses its key stops the evaluation with what to fix, and no item is scored
/// (a resume would otherwise skip them as wrong for good).
#[tokio::test(flavor = "multi_thread")]
async fn a_refused_key_stops_the_evaluation_and_scores_nothing() {
    let s = server().await;
    let setup = setup(&s, "", "");
    let out = baton_tests::run_within(
        Duration::from_secs(60),
        Path::new(env!("CARGO_BIN_EXE_baton")),
        &[
            "eval",
            "run",
            path(&setup.suite),
            "--pool",
            path(&setup.pool),
            "--db",
            path(&setup.db),
            "--strategies",
            "single:a",
            "--id",
            "key",
        ],
        None,
        &[("BATON_E2E_KEY", Some("sk-wrong-key-000000"))],
    )
    .await;
    assert_eq!(out.code, Some(2), "{}", out.stderr);
    assert!(out.stderr.contains("refused its key"), "{}", out.stderr);
    assert!(results(&setup, "key").is_empty());
}

/// `--from-hf`: a standard set read through the hub's dataset viewer (a loopback one speaking
/// its JSON): GSM8K's rows in pages of 100, kept as a suite file so a second run reads no row
/// again; a gated set refused without the token (and read with it, through a busy server's
/// 500s); an unknown one named.
#[tokio::test(flavor = "multi_thread")]
async fn a_standard_set_is_read_from_the_hub_once_and_scored() {
    use baton_testserver::hub::{HubOptions, TestHub};
    let s = server().await;
    let setup = setup(&s, "", "");
    let hub = TestHub::start(HubOptions::default()).await.unwrap();
    // 150 GSM8K rows: `a` knows the 8 with its needles, and nothing else.
    let gsm8k: Vec<Value> = (0..150)
        .map(|i| {
            if i < 8 {
                serde_json::json!({ "question": format!("<N{i}> What is {i} + 40?"), "answer": format!("{i} + 40 = {}\n#### {}", 40 + i, 40 + i) })
            } else {
                serde_json::json!({ "question": format!("Filler {i}?"), "answer": "It is one.\n#### 1" })
            }
        })
        .collect();
    hub.add_dataset("openai/gsm8k", "main", "test", gsm8k);
    hub.add_dataset("openai/gsm8k", "main", "train", vec![serde_json::json!({ "question": "t", "answer": "#### 1" })]);
    let mmlu = vec![
        serde_json::json!({ "question": "<C0> Which one?", "subject": "trivia", "choices": ["w", "x", "y", "z"], "answer": 0 }),
        serde_json::json!({ "question": "<C1> Which one?", "subject": "trivia", "choices": ["w", "x", "y", "z"], "answer": 1 }),
    ];
    hub.add_dataset("cais/mmlu", "all", "test", mmlu);
    hub.gate("cais/mmlu");
    let cache = setup.dir.path().join("cache");
    let run = |args: Vec<String>, token: Option<&'static str>| {
        let (endpoint, cache) = (hub.endpoint(), cache.clone());
        async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            baton_tests::run_within(
                Duration::from_secs(120),
                Path::new(env!("CARGO_BIN_EXE_baton")),
                &args,
                None,
                &[
                    ("BATON_E2E_KEY", Some(TEST_KEY)),
                    ("HF_DATASETS_SERVER", Some(&endpoint)),
                    ("HF_TOKEN", token),
                    ("HUGGING_FACE_HUB_TOKEN", None),
                    ("XDG_CACHE_HOME", cache.to_str()),
                    // No keychain to read a stored token from.
                    ("DBUS_SESSION_BUS_ADDRESS", Some("unix:path=/nonexistent")),
                ],
            )
            .await
        }
    };
    let eval = |from: &str, strategy: &str, id: &str| -> Vec<String> {
        [
            "eval",
            "run",
            "--from-hf",
            from,
            "--strategies",
            strategy,
            "--id",
            id,
            "--concurrency",
            "8",
            "--json",
            "--pool",
            path(&setup.pool),
            "--db",
            path(&setup.db),
        ]
        .map(str::to_owned)
        .to_vec()
    };
    let viewer = |hub: &TestHub| hub.requests().into_iter().filter(|r| !r.path.contains("/resolve/")).count();

    let out = run(eval("openai/gsm8k:main", "single:a", "gsm"), None).await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let summary: Value = serde_json::from_str(out.stdout.lines().last().unwrap()).expect("JSON");
    let a = &summary["strategies"][0];
    assert_eq!((a["n"].as_u64(), a["accuracy"].as_f64()), (Some(150), Some(8.0 / 150.0)), "{a}");
    let paths: Vec<String> = hub.requests().iter().map(|r| r.path.clone()).collect();
    assert_eq!(
        paths,
        [
            "/splits?dataset=openai/gsm8k",
            "/rows?dataset=openai/gsm8k&config=main&split=test&offset=0&length=100",
            "/rows?dataset=openai/gsm8k&config=main&split=test&offset=100&length=100",
        ]
    );
    let kept = cache.join("baton/datasets/openai__gsm8k/main__test.jsonl");
    assert_eq!(std::fs::read_to_string(&kept).unwrap().lines().count(), 150);
    // Again, resumed: the kept file, no row read again and no call made.
    let calls = s.requests().len();
    let again = run(eval("openai/gsm8k:main", "single:a", "gsm"), None).await;
    assert_eq!(again.code, Some(0), "{}", again.stderr);
    assert_eq!((viewer(&hub), s.requests().len()), (3, calls));

    let refused = run(eval("cais/mmlu:all", "single:b", "mmlu"), None).await;
    assert_eq!(refused.code, Some(2), "{}", refused.stderr);
    assert!(refused.stderr.contains("gated") && refused.stderr.contains("HF_TOKEN"), "{}", refused.stderr);
    hub.fail_viewer(2);
    let read = run(eval("cais/mmlu:all", "single:b", "mmlu"), Some("hf_test_token")).await;
    assert_eq!(read.code, Some(0), "a busy viewer's 500s are retried: {}", read.stderr);
    let summary: Value = serde_json::from_str(read.stdout.lines().last().unwrap()).expect("JSON");
    assert_eq!(
        (summary["strategies"][0]["n"].as_u64(), summary["strategies"][0]["accuracy"].as_f64()),
        (Some(2), Some(1.0))
    );

    // A split the viewer serves with cells cut short is refused, not kept half-written.
    hub.add_dataset(
        "openai/openai_humaneval",
        "openai_humaneval",
        "test",
        vec![serde_json::json!({
            "task_id": "HumanEval/0", "prompt": "def f():\n", "test": "def check(c):\n    pass\n", "entry_point": "f",
        })],
    );
    hub.truncate("openai/openai_humaneval", "test");
    let cut = run(eval("openai/openai_humaneval", "single:a", "he"), None).await;
    assert_eq!(cut.code, Some(2), "{}", cut.stderr);
    assert!(cut.stderr.contains("cut short (test)"), "{}", cut.stderr);
    assert!(!cache.join("baton/datasets/openai__openai_humaneval").exists(), "nothing kept");

    let unknown = run(eval("nobody/nothing", "single:a", "x"), None).await;
    assert_eq!(unknown.code, Some(2));
    assert!(unknown.stderr.contains("nobody/nothing was not found"), "{}", unknown.stderr);
}
