//! The `baton` binary end to end, against loopback servers that speak the OpenAI, Anthropic and
//! Gemini wire formats.

use std::time::{Duration, Instant};

use baton_tests::{Output, TEST_KEY, W, fixture, write_pool};
use baton_testserver::{Options, TestServer};
use serde_json::Value;

/// Every `--json` output against docs/json.md.
#[path = "cli/json.rs"]
mod json;

async fn server() -> TestServer {
    TestServer::start_with(Options { key: Some(TEST_KEY.into()), ..Options::default() }).await.expect("server")
}

/// Runs the `baton` binary this package builds.
async fn baton(args: &[&str], stdin: Option<&str>, key: &str) -> Output {
    baton_tests::run(std::path::Path::new(env!("CARGO_BIN_EXE_baton")), args, stdin, key).await
}

fn path(p: &std::path::Path) -> &str {
    p.to_str().expect("utf-8 path")
}

#[tokio::test(flavor = "multi_thread")]
async fn plan_parse_prints_normalized_json_and_rejects_bad_plans_with_exit_2() {
    let plan = fixture("fanout-plan.txt");
    let out = baton(&["plan", "parse", path(&plan)], None, "").await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let json: Value = serde_json::from_str(out.stdout.trim()).expect("one JSON object");
    assert_eq!(json["model_id"], serde_json::json!([0, 1, 2, 3]));
    assert_eq!(json["access_list"], serde_json::json!([[], [], [], "all"]));
    assert_eq!(json["subtasks"][2], "Attempt the problem a third way.");

    let stdin = baton(&["plan", "parse"], Some("model_id=[1]\nsubtasks=['x']\naccess_list=[[]]"), "").await;
    assert_eq!(stdin.code, Some(0));
    assert_eq!(stdin.stdout.trim(), r#"{"version":1,"model_id":[1],"subtasks":["x"],"access_list":[[]]}"#);

    let bad = baton(&["plan", "parse", path(&fixture("bad-plan.txt"))], None, "").await;
    assert_eq!(bad.code, Some(2));
    assert!(bad.stdout.is_empty());
    assert!(
        bad.stderr.contains("bad-plan.txt: line 3, column 20: access_list[1]: step 1 cannot see its own output"),
        "{}",
        bad.stderr
    );

    let dir = tempfile::tempdir().expect("tempdir");
    let s = server().await;
    let pool = write_pool(dir.path(), &s, "", &[W("only", "openai", "m")]);
    let out = baton(&["plan", "parse", "--pool", path(&pool), path(&plan)], None, "").await;
    assert_eq!(out.code, Some(2));
    assert!(
        out.stderr.contains("model_id[1]: model 1 is not in the pool; the pool has 1 worker (0..=0)"),
        "{}",
        out.stderr
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn ask_runs_a_plan_over_all_three_wire_formats() {
    let s = server().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = write_pool(
        dir.path(),
        &s,
        "",
        &[
            W("gpt", "openai", "gpt-5"),
            W("claude", "anthropic", "claude-sonnet-4-5"),
            W("gemini", "gemini", "gemini-2.5-pro"),
        ],
    );
    let plan = fixture("chain-plan.txt");
    let out = baton(&["ask", "--pool", path(&pool), "--plan", path(&plan), "What is 2+2?"], None, TEST_KEY).await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert_eq!(
        out.stdout, "gemini-2.5-pro (saw 2 earlier answers) answers: What is 2+2?\n",
        "only the answer on stdout (the last step is asked the question)"
    );
    assert!(out.stderr.contains("plan: 3 steps"), "{}", out.stderr);
    assert!(out.stderr.contains("step 2 finished   gemini"), "{}", out.stderr);
    assert!(out.stderr.contains("done in"), "{}", out.stderr);
    let reqs = s.requests();
    assert_eq!(
        reqs.iter().map(|r| r.path.as_str()).collect::<Vec<_>>(),
        vec!["/v1/chat/completions", "/v1/messages", "/v1beta/models/gemini-2.5-pro:streamGenerateContent"]
    );
    assert!(!out.stderr.contains(TEST_KEY) && !out.stdout.contains(TEST_KEY));
}

#[tokio::test(flavor = "multi_thread")]
async fn ask_json_writes_every_event_as_a_json_line() {
    let s = server().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let pool =
        write_pool(dir.path(), &s, "", &[W("a", "anthropic", "a"), W("b", "openai", "b"), W("c", "gemini", "c")]);
    let out = baton(
        &["ask", "--json", "--pool", path(&pool), "--plan", path(&fixture("chain-plan.txt")), "Q"],
        None,
        TEST_KEY,
    )
    .await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let events: Vec<Value> = out.stdout.lines().map(|l| serde_json::from_str(l).expect("JSON line")).collect();
    let types: Vec<&str> = events.iter().map(|e| e["type"].as_str().expect("type")).collect();
    assert_eq!(types.first(), Some(&"run_started"));
    assert_eq!(types[1], "plan_ready");
    assert_eq!(types.last(), Some(&"run_finished"));
    for t in ["step_started", "step_delta", "step_finished"] {
        assert!(types.iter().filter(|x| **x == t).count() >= 3, "{t}: {types:?}");
    }
    let last = events.last().expect("event");
    assert_eq!(last["answer"], "c (saw 2 earlier answers) answers: Q");
    assert_eq!(last["totals"]["calls"], 3);
    let started = events.iter().find(|e| e["type"] == "step_started" && e["step"] == 1).expect("step 1");
    assert_eq!(started["messages"][1]["role"], "assistant", "the exact messages are in the event");
    assert!(!out.stdout.contains(TEST_KEY));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_fan_out_plan_visibly_runs_its_independent_steps_at_the_same_time() {
    let s = server().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = write_pool(
        dir.path(),
        &s,
        "",
        &[
            W("one", "openai", "one;latency=400"),
            W("two", "anthropic", "two;latency=400"),
            W("three", "gemini", "three;latency=400"),
            W("judge", "openai", "judge;latency=400"),
        ],
    );
    let started = Instant::now();
    let out =
        baton(&["ask", "--pool", path(&pool), "--plan", path(&fixture("fanout-plan.txt")), "Q"], None, TEST_KEY).await;
    let wall = started.elapsed();
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    // Sequential would be 1.6 s of model time; parallel is two layers, 0.8 s.
    assert!(wall < Duration::from_millis(1500), "{wall:?}\n{}", out.stderr);
    let lines: Vec<&str> = out.stderr.lines().collect();
    let first_finish = lines.iter().position(|l| l.contains(" finished ")).expect("a step finished");
    for step in 0..3 {
        let start = lines.iter().position(|l| l.contains(&format!("step {step} started"))).expect("started");
        assert!(start < first_finish, "step {step} starts before any step finishes:\n{}", out.stderr);
    }
    assert!(out.stdout.starts_with("judge (saw 3 earlier answers)"), "{}", out.stdout);
}

#[tokio::test(flavor = "multi_thread")]
async fn whole_body_workers_work_too() {
    let s = server().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let pool =
        write_pool(dir.path(), &s, "", &[W("a", "anthropic", "a"), W("b", "gemini", "b"), W("c", "openai", "c")]);
    let text = std::fs::read_to_string(&pool).expect("pool").replace("api_key_env", "stream = false\napi_key_env");
    std::fs::write(&pool, text).expect("write");
    let out =
        baton(&["ask", "--pool", path(&pool), "--plan", path(&fixture("chain-plan.txt")), "Q"], None, TEST_KEY).await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert_eq!(out.stdout, "c (saw 2 earlier answers) answers: Q\n");
    assert!(s.requests().iter().all(|r| r.body.get("stream") != Some(&Value::Bool(true))));
    assert!(s.requests().iter().any(|r| r.path.ends_with(":generateContent")));
}

#[tokio::test(flavor = "multi_thread")]
async fn exit_codes_say_what_went_wrong() {
    let s = server().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let pool =
        write_pool(dir.path(), &s, "", &[W("a", "openai", "a"), W("b", "anthropic", "b"), W("c", "gemini", "c")]);
    let plan = fixture("chain-plan.txt");

    // A wrong key: the run fails (1), the error names the kind, nothing on stdout.
    let out = baton(&["ask", "--pool", path(&pool), "--plan", path(&plan), "Q"], None, "sk-wrong").await;
    assert_eq!(out.code, Some(1), "{}", out.stderr);
    assert!(out.stdout.is_empty());
    assert!(out.stderr.contains("step 0 failed") && out.stderr.contains("Auth"), "{}", out.stderr);
    assert!(out.stderr.contains("DependencyFailed"), "{}", out.stderr);
    assert!(!out.stderr.contains("sk-wrong"), "keys never appear in output");

    // A broken pool: bad input (2), naming the file, the worker and the field.
    let broken = dir.path().join("broken.toml");
    std::fs::write(&broken, "[[worker]]\nname = \"x\"\nprovider = \"openia\"\nmodel = \"m\"\n").expect("write");
    let out = baton(&["ask", "--pool", path(&broken), "--plan", path(&plan), "Q"], None, TEST_KEY).await;
    assert_eq!(out.code, Some(2));
    assert!(
        out.stderr.contains("broken.toml:1: worker 0 (\"x\"): field `provider`: unknown provider \"openia\""),
        "{}",
        out.stderr
    );

    // A plan that does not parse: bad input (2).
    let out =
        baton(&["ask", "--pool", path(&pool), "--plan", path(&fixture("bad-plan.txt")), "Q"], None, TEST_KEY).await;
    assert_eq!(out.code, Some(2));

    // A missing pool file says how to make one.
    let out = baton(&["ask", "--pool", "/nonexistent/pool.toml", "--plan", path(&plan), "Q"], None, TEST_KEY).await;
    assert_eq!(out.code, Some(2));
    assert!(out.stderr.contains("no such file"), "{}", out.stderr);
}

/// A number out of its range stops a command before it starts (exit 2), naming the flag and the
/// range: NaN or infinity would cap nothing, and 0 or less would refuse everything.
#[tokio::test(flavor = "multi_thread")]
async fn a_flag_out_of_range_is_refused_before_anything_runs() {
    let s = server().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = write_pool(dir.path(), &s, "", &[W("a", "openai", "a"), W("b", "openai", "b")]);
    let cases: [(&[&str], &str); 7] = [
        (&["serve", "--pool", path(&pool), "--daily-max-cost-usd=nan"], "--daily-max-cost-usd"),
        (&["serve", "--pool", path(&pool), "--daily-max-cost-usd=-1"], "--daily-max-cost-usd"),
        (&["serve", "--pool", path(&pool), "--daily-max-cost-usd=inf"], "--daily-max-cost-usd"),
        (&["eval", "run", "mmlu", "--pool", path(&pool), "--max-cost-usd", "inf"], "--max-cost-usd"),
        (&["eval", "run", "mmlu", "--pool", path(&pool), "--max-cost-usd", "0"], "--max-cost-usd"),
        (&["pool", "learn", "mmlu", "--pool", path(&pool), "--max-cost-usd", "NaN"], "--max-cost-usd"),
        (&["bench", "conductor", "--temperature", "7"], "--temperature"),
    ];
    for (args, flag) in cases {
        let out = baton(args, None, TEST_KEY).await;
        assert_eq!(out.code, Some(2), "{args:?}: {}", out.stderr);
        assert!(out.stderr.contains(flag) && out.stderr.contains("must be a number"), "{args:?}: {}", out.stderr);
        assert!(out.stderr.contains("at most"), "the range is named: {}", out.stderr);
    }
    assert!(s.requests().is_empty(), "nothing ran");
}

#[tokio::test(flavor = "multi_thread")]
async fn pool_check_reports_each_worker() {
    let s = server().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = write_pool(
        dir.path(),
        &s,
        "",
        &[
            W("good", "openai", "good"),
            W("overloaded", "anthropic", "o;fail=529"),
            W("slow", "gemini", "slow;ttfb=150"),
        ],
    );
    let out = baton(&["pool", "check", "--json", "--pool", path(&pool)], None, TEST_KEY).await;
    assert_eq!(out.code, Some(1), "one worker fails: {}", out.stderr);
    let lines: Vec<Value> = out.stdout.lines().map(|l| serde_json::from_str(l).expect("JSON")).collect();
    assert_eq!(lines.len(), 3);
    assert_eq!(lines[0]["ok"], true);
    assert_eq!(lines[1]["ok"], false);
    assert_eq!(lines[1]["error"]["kind"], "overloaded");
    assert_eq!(lines[1]["error"]["status"], 529);
    assert!(lines[2]["latency_ms"].as_u64() >= Some(150));
    let good = s.requests().into_iter().find(|r| r.model == "good").expect("good was called");
    assert_eq!(good.body["max_completion_tokens"], 16, "checks are minimal calls");

    let out = baton(&["pool", "check", "--pool", path(&pool)], None, "sk-wrong").await;
    assert_eq!(out.code, Some(1));
    assert_eq!(
        out.stdout.lines().filter(|l| l.starts_with("FAILED") && l.contains("auth")).count(),
        3,
        "{}",
        out.stdout
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn interrupting_a_run_exits_130() {
    let s = server().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = write_pool(dir.path(), &s, "", &[W("slow", "openai", "slow;latency=60000;chunks=120")]);
    let plan = "model_id = [0]\nsubtasks = ['take your time']\naccess_list = [[]]";
    let plan_path = dir.path().join("plan.txt");
    std::fs::write(&plan_path, plan).expect("write");
    let args = ["ask", "--pool", path(&pool), "--plan", path(&plan_path), "Q"];
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(args)
        .env("BATON_E2E_KEY", TEST_KEY)
        .env("BATON_ALLOW_KEY_ENV", baton_tests::consent(&args).expect("the pool names its servers"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let pid = child.id().expect("pid").to_string();
    let status = std::process::Command::new("kill").args(["-INT", &pid]).status().expect("kill");
    assert!(status.success());
    let started = Instant::now();
    let out =
        tokio::time::timeout(Duration::from_secs(30), child.wait_with_output()).await.expect("exits").expect("output");
    // The answer would take a minute: well under it is prompt, on a busy machine too.
    assert!(started.elapsed() < Duration::from_secs(15), "stops promptly");
    assert_eq!(out.status.code(), Some(130));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("cancelled"), "{stderr}");
}

/// A pool on `server` whose conductor is a tiny random model written into `dir`.
fn pool_with_tiny_conductor(dir: &std::path::Path, server: &TestServer) -> (std::path::PathBuf, std::path::PathBuf) {
    let model = dir.join("tiny-conductor");
    baton_tinymodel::write_safetensors_model(&model, &baton_tinymodel::TinySpec::default()).expect("write model");
    let pool = write_pool(dir, server, "", &[W("a", "openai", "a"), W("b", "anthropic", "b"), W("c", "gemini", "c")]);
    let text = std::fs::read_to_string(&pool).expect("pool");
    // Short reasoning keeps a random model's plans quick.
    let conductor = format!(
        "[conductor]\nmodel = \"{}\"\ndevice = \"cpu\"\nmax_reasoning_chars = 24\nmax_subtask_chars = 16\ntemperature = 1.0\n",
        model.display()
    );
    std::fs::write(&pool, format!("{conductor}{text}")).expect("write pool");
    (pool, model)
}

#[tokio::test(flavor = "multi_thread")]
async fn ask_without_a_plan_lets_the_local_conductor_write_one() {
    let s = server().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let (pool, _) = pool_with_tiny_conductor(dir.path(), &s);
    let out = baton(&["ask", "--pool", path(&pool), "What is 6 times 7?"], None, TEST_KEY).await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(out.stderr.contains("loading the conductor") && out.stderr.contains("loaded in"), "{}", out.stderr);
    assert!(out.stderr.contains("plan: "), "{}", out.stderr);
    assert!(out.stdout.contains("answers:"), "the last worker's answer: {}", out.stdout);
    assert!(!s.requests().is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn plan_prints_the_conductors_plan_without_running_it() {
    let s = server().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let (pool, model) = pool_with_tiny_conductor(dir.path(), &s);
    let out = baton(&["plan", "--pool", path(&pool), "--json", "Why is the sky blue?"], None, TEST_KEY).await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let json: Value = serde_json::from_str(out.stdout.trim()).expect("one JSON object");
    let n = json["model_id"].as_array().map_or(0, Vec::len);
    assert!((1..=5).contains(&n), "{json}");
    assert!(json["model_id"].as_array().into_iter().flatten().all(|id| id.as_u64() < Some(3)));
    assert!(s.requests().is_empty(), "planning calls no worker");

    let text = baton(&["plan", "--pool", path(&pool), "--conductor", path(&model), "Why?"], None, TEST_KEY).await;
    assert_eq!(text.code, Some(0), "{}", text.stderr);
    assert!(text.stdout.contains("```python\nmodel_id = ["), "{}", text.stdout);
}

#[tokio::test(flavor = "multi_thread")]
async fn without_a_conductor_ask_says_how_to_configure_one() {
    let s = server().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = write_pool(dir.path(), &s, "", &[W("a", "openai", "a")]);
    let out = baton(&["ask", "--pool", path(&pool), "Q"], None, TEST_KEY).await;
    assert_eq!(out.code, Some(2));
    assert!(out.stderr.contains("no conductor is configured"), "{}", out.stderr);
    let out = baton(&["ask", "--pool", path(&pool), "--conductor", "/nowhere/model.gguf", "Q"], None, TEST_KEY).await;
    assert_eq!(out.code, Some(2));
    assert!(out.stderr.contains("/nowhere/model.gguf: not found"), "{}", out.stderr);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_local_conductor_needs_no_network_and_leaves_the_home_cache_alone() {
    let s = server().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let (pool, _) = pool_with_tiny_conductor(dir.path(), &s);
    let home = tempfile::tempdir().expect("home");
    // A new network namespace has no interfaces at all: any download attempt fails.
    let out = tokio::process::Command::new("unshare")
        .args(["--net", "--", env!("CARGO_BIN_EXE_baton"), "plan", "--json", "--pool", path(&pool), "Q"])
        .env("HOME", home.path())
        .env("BATON_KEEP_WARM", "0")
        .env_remove("XDG_DATA_HOME")
        .env_remove("XDG_CACHE_HOME")
        .env_remove("HF_HOME")
        .output()
        .await
        .expect("unshare runs (util-linux)");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "planning offline failed: {stderr}");
    assert!(!home.path().join(".cache").join("huggingface").exists(), "nothing in the user's HF cache");
    // Whatever the engine writes (mistral.rs 0.8 made an empty hub cache, 0.9 makes none) goes
    // under Baton's own data directory, and nothing else in the home directory is touched.
    let baton_dir = home.path().join(".local/share/baton");
    let mut stack = vec![home.path().to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("read home").map(|e| e.expect("entry").path()) {
            let ancestor = baton_dir.starts_with(&entry);
            assert!(ancestor || entry.starts_with(&baton_dir), "written outside Baton's data dir: {}", entry.display());
            if ancestor && entry != baton_dir {
                stack.push(entry);
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_fully_offline_pool_of_local_workers() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = dir.path().join("tiny");
    baton_tinymodel::write_safetensors_model(&model, &baton_tinymodel::TinySpec::default()).expect("write model");
    let pool = dir.path().join("pool.toml");
    let m = model.display();
    std::fs::write(
        &pool,
        format!(
            "[conductor]\nmodel = \"{m}\"\ndevice = \"cpu\"\nmax_reasoning_chars = 16\nmax_subtask_chars = 12\n\n\
             [[worker]]\nname = \"local-a\"\nprovider = \"local\"\nmodel = \"{m}\"\nmax_tokens = 12\n\n\
             [[worker]]\nname = \"local-b\"\nprovider = \"local\"\nmodel = \"{m}\"\nmax_tokens = 12\n"
        ),
    )
    .expect("write pool");
    let out = baton(&["ask", "--json", "--pool", path(&pool), "Say something."], None, "").await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let events: Vec<Value> = out.stdout.lines().map(|l| serde_json::from_str(l).expect("JSON line")).collect();
    assert_eq!(events.last().map(|e| e["type"].clone()), Some(Value::from("run_finished")));
    let finished = events.iter().filter(|e| e["type"] == "step_finished").count();
    assert!(finished >= 1, "local workers answered");
    assert_eq!(events.last().map(|e| e["totals"]["cost_complete"].clone()), Some(Value::Bool(true)), "local is free");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_remote_conductor_gets_the_plan_grammar_its_server_reads() {
    let s = server().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let conductor = format!(
        "[conductor]\nurl = \"{}\"\nmodel = \"big-conductor\"\napi_key_env = \"BATON_E2E_KEY\"\ngrammar = \"vllm\"\n",
        s.base_url(baton_testserver::Wire::OpenAi)
    );
    let pool = write_pool(dir.path(), &s, &conductor, &[W("gpt", "openai", "gpt-5"), W("claude", "anthropic", "c")]);
    let plan = "Two views, then a judge.\n```python\nmodel_id = [0, 1]\nsubtasks = [\"Answer.\", \"Check.\"]\naccess_list = [[], \"all\"]\n```";
    s.queue_replies("big-conductor", [plan, plan]);
    let out = baton(&["ask", "--pool", path(&pool), "What is 2+2?"], None, TEST_KEY).await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert_eq!(out.stdout, "c (saw 1 earlier answers) answers: What is 2+2?\n");
    let first = &s.requests()[0];
    assert_eq!(first.body["model"], "big-conductor");
    let regex = first.body["structured_outputs"]["regex"].as_str().expect("vLLM's field");
    assert!(regex.contains("model_id = \\[(?:0|1)"), "the pool's worker ids: {regex}");

    // The flag overrides the pool: llama.cpp takes GBNF in "grammar".
    let args = ["plan", "--pool", path(&pool), "--conductor-grammar", "llama.cpp", "--json", "What is 2+2?"];
    let out = baton(&args, None, TEST_KEY).await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert_eq!(
        out.stdout.trim(),
        r#"{"version":1,"model_id":[0,1],"subtasks":["Answer.","Check."],"access_list":[[],"all"]}"#
    );
    let last = s.requests().into_iter().last().expect("a request");
    assert!(last.body["grammar"].as_str().is_some_and(|g| g.starts_with("root ::= ")), "{}", last.body);
    assert!(last.body.get("structured_outputs").is_none());

    let bad = baton(&["plan", "--pool", path(&pool), "--conductor-grammar", "ollama", "Q"], None, TEST_KEY).await;
    assert_eq!(bad.code, Some(2));
    assert!(bad.stderr.contains("expected one of vllm, sglang, llama.cpp or none"), "{}", bad.stderr);
}

/// A recursive plan from a remote conductor, with a rate-limited worker and a broken stream:
/// `--json` reports the conductor's and the workers' shares apart, and the totals are exactly
/// the sum of what the server reported for every request it received, failed attempts
/// included (from its own request log), but for the broken stream's output, which counts the
/// text that came.
#[tokio::test(flavor = "multi_thread")]
async fn ask_json_totals_are_every_request_the_servers_answered() {
    let s = server().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let conductor = format!(
        "[conductor]\nurl = \"{}\"\nmodel = \"big-conductor\"\napi_key_env = \"BATON_E2E_KEY\"\n\n[recursion]\nenabled = true\nmax_depth = 1\n",
        s.base_url(baton_testserver::Wire::OpenAi)
    );
    let pool = write_pool(
        dir.path(),
        &s,
        &conductor,
        &[W("gpt", "openai", "gpt;fail=429x1;retry_after=0"), W("claude", "anthropic", "claude;stream_error=1")],
    );
    // Round 0 gives its last step to the conductor (Model 2); round 1 finishes the work.
    let first = "```python\nmodel_id = [0, 2]\nsubtasks = [\"Draft.\", \"Improve the draft.\"]\naccess_list = [[], \"all\"]\n```";
    let second = "```python\nmodel_id = [1]\nsubtasks = [\"Polish it.\"]\naccess_list = [\"all\"]\n```";
    s.queue_replies("big-conductor", [first, second]);
    let out = baton(&["ask", "--json", "--pool", path(&pool), "What is 2+2?"], None, TEST_KEY).await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let last: Value = serde_json::from_str(out.stdout.lines().last().expect("events")).expect("json");
    assert_eq!(last["type"], "run_finished", "{last}");
    let totals = &last["totals"];

    let requests = s.requests();
    let sum = |conductor: bool| {
        requests.iter().filter(|r| (r.model == "big-conductor") == conductor).fold((0u64, 0u64, 0u64), |acc, r| {
            let u = r.reported();
            (acc.0 + 1, acc.1 + u.input_tokens, acc.2 + u.output_tokens)
        })
    };
    let figures = |v: &Value| {
        (
            v["calls"].as_u64().unwrap(),
            v["usage"]["input_tokens"].as_u64().unwrap(),
            v["usage"]["output_tokens"].as_u64().unwrap(),
        )
    };
    let (conductor, mut workers) = (sum(true), sum(false));
    assert_eq!(conductor.0, 2, "two plans");
    assert_eq!(workers.0, 4, "gpt twice (a 429 first), claude twice (a broken stream first)");
    let broken = requests.iter().find(|r| r.model.starts_with("claude")).expect("claude's first call").reported();
    assert!(broken.input_tokens > 0, "the broken stream's usage counts: {broken:?}");
    // Anthropic opens a stream with a placeholder of one output token; the broken stream's
    // output counts the text that came before it broke (claude's step is round 1's first),
    // as an estimate, not that 1.
    let events: Vec<Value> = out.stdout.lines().map(|l| serde_json::from_str(l).expect("json")).collect();
    let at = |e: &Value| e["round"] == 1 && e["step"] == 0;
    let broke = events.iter().position(|e| e["type"] == "step_retrying" && at(e)).expect("claude's retry");
    let cut: usize = events[..broke]
        .iter()
        .filter(|e| e["type"] == "step_delta" && at(e))
        .map(|e| e["text"].as_str().map_or(0, str::len))
        .sum();
    assert!(cut > 1 && broken.output_tokens == 1, "{cut} bytes, {broken:?}");
    workers.2 = workers.2 - broken.output_tokens + cut as u64;
    assert_eq!(totals["workers"]["usage"]["estimated"], true, "{totals}");
    assert_eq!(figures(&totals["conductor"]), conductor, "{totals}");
    assert_eq!(figures(&totals["workers"]), workers, "{totals}");
    assert_eq!(figures(totals), (conductor.0 + workers.0, conductor.1 + workers.1, conductor.2 + workers.2));
    // An unpriced conductor and workers named "gpt"/"claude" (test-server names, not in the price data):
    assert_eq!(totals["cost_complete"], false);
    let unknown: Vec<&str> = totals["cost_unknown_for"].as_array().unwrap().iter().filter_map(Value::as_str).collect();
    assert_eq!(unknown, ["claude", "gpt", "the conductor"]);
}

#[tokio::test]
async fn logs_path_prints_where_the_logs_go_and_a_command_writes_there() {
    let dir = tempfile::tempdir().expect("tempdir");
    let logs = dir.path().join("my-logs");
    let logs_str = logs.to_str().expect("utf-8");
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_baton"));
    let env = [("BATON_LOG_DIR", Some(logs_str))];
    let out = baton_tests::run_with(bin, &["logs", "path"], None, &env).await;
    assert_eq!((out.code, out.stdout.trim()), (Some(0), logs_str), "{}", out.stderr);
    assert!(!logs.exists(), "printing the path writes nothing");
    // A command that fails leaves its reason in the log.
    let missing = dir.path().join("no-pool.toml");
    let out = baton_tests::run_with(bin, &["pool", "check", "--pool", missing.to_str().unwrap()], None, &env).await;
    assert_eq!(out.code, Some(2), "{}", out.stderr);
    let files: Vec<_> = std::fs::read_dir(&logs).expect("the log directory").flatten().collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let name = files[0].file_name().into_string().unwrap();
    assert!(name.starts_with("baton.") && name.ends_with(".log"), "{name}");
    let log = std::fs::read_to_string(files[0].path()).unwrap();
    assert!(log.contains("the command failed") && log.contains("no-pool.toml"), "{log}");
}

/// A conductor whose plans copy an example workflow: the first plan is rejected and the
/// conductor asked again without examples; the second names the example's number too, so the
/// question goes verbatim to the pool's `fallback_worker` alone. `--json` says each step of
/// that, the history keeps it, and with `fallback = false` the copied plan runs as written.
#[tokio::test(flavor = "multi_thread")]
async fn a_plan_that_copies_an_example_falls_back_to_one_worker_and_says_so() {
    let s = server().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let conductor = |extra: &str| {
        format!(
            "[conductor]\nurl = \"{}\"\nmodel = \"copier\"\napi_key_env = \"BATON_E2E_KEY\"\nfallback_worker = \"b\"\n{extra}",
            s.base_url(baton_testserver::Wire::OpenAi)
        )
    };
    // v3 shows its worked example for 360 to a question about divisors; this plan copies it.
    let copied = "```python\nmodel_id = [0]\nsubtasks = [\"Factor 360; count divisors from the exponents.\"]\naccess_list = [[]]\n```";
    let question = "How many positive divisors does 196 have?";
    let pool = write_pool(dir.path(), &s, &conductor(""), &[W("a", "openai", "a"), W("b", "anthropic", "b")]);
    s.queue_replies("copier", [copied, copied]);
    let db = dir.path().join("history.sqlite");
    let out = baton(&["ask", "--json", "--db", path(&db), "--pool", path(&pool), question], None, TEST_KEY).await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let events: Vec<Value> = out.stdout.lines().map(|l| serde_json::from_str(l).expect("json")).collect();
    let of = |t: &str| events.iter().filter(|e| e["type"] == t).collect::<Vec<_>>();
    let rejected = of("plan_rejected");
    assert_eq!(rejected.len(), 2, "{}", out.stdout);
    assert_eq!((&rejected[0]["retry"], &rejected[1]["retry"]), (&Value::Bool(true), &Value::Bool(false)));
    assert!(rejected[0]["reason"].as_str().unwrap().contains("\"360\""), "{}", rejected[0]);
    assert_eq!(rejected[0]["raw"], copied);
    assert!(rejected[0]["prompt"]["system"].as_str().unwrap().contains("Factor 360"), "the first prompt showed it");
    assert!(!rejected[1]["prompt"]["system"].as_str().unwrap().contains("Example ["), "the second showed none");
    let ready = of("plan_ready");
    assert_eq!(ready.len(), 1);
    let fallback = ready[0]["fallback"].as_str().expect("the plan says it is a fallback");
    assert!(fallback.contains("went to b alone"), "{fallback}");
    assert_eq!(ready[0]["plan"]["model_id"], serde_json::json!([1]), "{}", ready[0]);
    assert_eq!(ready[0]["plan"]["subtasks"], serde_json::json!([question]));
    // Worker b alone, given the question itself; worker a was never called.
    let workers: Vec<_> = s.requests().into_iter().filter(|r| r.model != "copier").collect();
    assert_eq!(workers.len(), 1);
    assert!(workers[0].model.starts_with('b'));
    assert!(workers[0].body.to_string().contains(question), "{}", workers[0].body);
    assert_eq!(events.last().unwrap()["type"], "run_finished");
    // The history keeps the rejected attempts and the reason.
    let runs = baton(&["history", "list", "--json", "--db", path(&db)], None, TEST_KEY).await;
    let run: Value = serde_json::from_str(runs.stdout.lines().next().expect("the run is recorded")).expect("json");
    let run = run["id"].to_string();
    let shown = baton(&["history", "show", &run, "--json", "--db", path(&db)], None, TEST_KEY).await;
    assert_eq!(shown.code, Some(0), "{}", shown.stderr);
    let tree: Value = serde_json::from_str(&shown.stdout).expect("json");
    let plan = &tree["plans"][0];
    assert_eq!(plan["fallback"], fallback);
    assert_eq!(plan["rejected"].as_array().map(Vec::len), Some(2), "{plan}");

    // Off: the copied plan runs as written, on worker a.
    let pool = write_pool(
        dir.path(),
        &s,
        &conductor("fallback = false\n"),
        &[W("a", "openai", "a"), W("b", "anthropic", "b")],
    );
    s.queue_replies("copier", [copied]);
    let before = s.requests().len();
    let out = baton(&["ask", "--json", "--pool", path(&pool), question], None, TEST_KEY).await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(!out.stdout.contains("plan_rejected") && !out.stdout.contains("\"fallback\""), "{}", out.stdout);
    let after: Vec<_> = s.requests().into_iter().skip(before).filter(|r| r.model != "copier").collect();
    assert_eq!(after.len(), 1);
    assert!(after[0].model.starts_with('a'));

    // v3 promises the conductor that every worker sees the question: a pool that hides it is
    // refused before anything is asked, naming both ways out.
    let hidden = format!("show_question = false\n{}", conductor(""));
    let pool = write_pool(dir.path(), &s, &hidden, &[W("a", "openai", "a"), W("b", "anthropic", "b")]);
    let before = s.requests().len();
    let out = baton(&["ask", "--pool", path(&pool), question], None, TEST_KEY).await;
    assert_ne!(out.code, Some(0), "{}", out.stdout);
    assert!(out.stderr.contains("show_question = false") && out.stderr.contains("prompt = \"v2\""), "{}", out.stderr);
    assert_eq!(s.requests().len(), before, "nothing was asked");
}
