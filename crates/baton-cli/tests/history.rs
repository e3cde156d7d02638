//! `baton ask` records every run; `baton history` finds, shows, exports and deletes them. Real
//! SQLite files, the real binary, loopback provider servers.

use std::time::Duration;

use baton_tests::{Output, TEST_KEY, W, fixture, write_pool};
use baton_testserver::{Options, TestServer};
use serde_json::Value;

async fn server(key: &str) -> TestServer {
    TestServer::start_with(Options { key: Some(key.into()), ..Options::default() }).await.expect("server")
}

async fn baton(args: &[&str], key: &str) -> Output {
    baton_tests::run(std::path::Path::new(env!("CARGO_BIN_EXE_baton")), args, None, key).await
}

fn path(p: &std::path::Path) -> &str {
    p.to_str().expect("utf-8 path")
}

fn json_lines(out: &Output) -> Vec<Value> {
    out.stdout.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}"))).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn every_ask_is_recorded_and_found_again() {
    let s = server(TEST_KEY).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("history.sqlite");
    // The answers echo their subtasks (not the question and its conversation), so a search
    // finds each question in its own run only.
    let pool = write_pool(
        dir.path(),
        &s,
        "question_to_answer_step = false",
        &[W("solver", "openai", "s"), W("checker", "anthropic", "c"), W("writer", "gemini", "w")],
    );
    let plan = fixture("chain-plan.txt");
    let ask = |q: &'static str, extra: &'static [&'static str]| {
        let (pool, plan, db) = (pool.clone(), plan.clone(), db.clone());
        async move {
            let mut args = vec!["ask", "--pool", path(&pool), "--plan", path(&plan), "--db", path(&db)];
            args.extend_from_slice(extra);
            args.push(q);
            baton(&args, TEST_KEY).await
        }
    };
    let first = ask("Why do zebras have stripes?", &[]).await;
    assert_eq!(first.code, Some(0), "{}", first.stderr);
    assert!(first.stderr.contains("recorded as run 1 in conversation 1 (baton history show 1)"), "{}", first.stderr);
    let followup = ask("And okapis?", &["--conversation", "1"]).await;
    assert_eq!(followup.code, Some(0), "{}", followup.stderr);
    let unrecorded = ask("Not kept", &["--no-history"]).await;
    assert_eq!(unrecorded.code, Some(0), "{}", unrecorded.stderr);
    assert!(!unrecorded.stderr.contains("recorded as"));

    let list = baton(&["history", "list", "--db", path(&db), "--json"], "").await;
    assert_eq!(list.code, Some(0), "{}", list.stderr);
    let runs = json_lines(&list);
    assert_eq!(runs.len(), 2, "--no-history left no run");
    assert_eq!((runs[0]["id"].as_i64(), runs[0]["status"].as_str()), (Some(2), Some("finished")));
    assert_eq!(runs[0]["question"], "And okapis?");
    assert_eq!(runs[1]["conversation_id"], runs[0]["conversation_id"], "the follow-up joined the conversation");
    let conversations = baton(&["history", "list", "--conversations", "--db", path(&db), "--json"], "").await;
    assert_eq!(json_lines(&conversations)[0]["runs"], 2);

    let text = baton(&["history", "list", "--db", path(&db)], "").await;
    assert!(
        text.stdout.lines().next().is_some_and(|l| l.contains("finished") && l.ends_with("And okapis?")),
        "{}",
        text.stdout
    );

    let search = baton(&["history", "search", "zebra", "--db", path(&db), "--json"], "").await;
    let hits = json_lines(&search);
    assert_eq!(hits.len(), 1, "{}", search.stdout);
    assert_eq!((hits[0]["id"].as_i64(), hits[0]["status"].as_str()), (Some(1), Some("finished")));
    assert_eq!(hits[0]["snippet"], "Why do [zebras] have stripes?");
    let by_subtask = baton(&["history", "search", "final answer", "--db", path(&db), "--json"], "").await;
    assert_eq!(json_lines(&by_subtask).len(), 2);

    let show = baton(&["history", "show", "1", "--db", path(&db)], "").await;
    assert_eq!(show.code, Some(0), "{}", show.stderr);
    assert!(show.stdout.starts_with("# Why do zebras have stripes?"), "{}", show.stdout);
    assert!(show.stdout.contains("### Step 1 · checker (finished"), "{}", show.stdout);
    let json = baton(&["history", "show", "1", "--db", path(&db), "--json"], "").await;
    let tree: Value = serde_json::from_str(json.stdout.trim()).expect("one JSON object");
    assert_eq!(tree["format"], "baton-run/1");
    assert_eq!(tree["steps"].as_array().map(Vec::len), Some(3));
    assert_eq!(
        tree["steps"][2]["request"]["messages"].as_array().map(Vec::len),
        Some(5),
        "two earlier turns + subtask"
    );

    let export = dir.path().join("conversation.md");
    let out = baton(
        &["history", "export", "--conversation", "1", "--format", "md", "-o", path(&export), "--db", path(&db)],
        "",
    )
    .await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let md = std::fs::read_to_string(&export).expect("written");
    assert!(md.starts_with("# Why do zebras have stripes?\n") && md.contains("## And okapis?"), "{md}");
    let out = baton(&["history", "export", "2", "--format", "json", "--db", path(&db)], "").await;
    assert_eq!(serde_json::from_str::<Value>(&out.stdout).expect("pretty JSON")["run"]["question"], "And okapis?");

    let missing = baton(&["history", "show", "99", "--db", path(&db)], "").await;
    assert_eq!(missing.code, Some(2));
    assert!(missing.stderr.contains("there is no run 99"), "{}", missing.stderr);
    let deleted = baton(&["history", "delete", "2", "--db", path(&db), "--json"], "").await;
    assert_eq!(json_lines(&deleted)[0]["deleted"], true);
    let list = baton(&["history", "list", "--db", path(&db), "--json"], "").await;
    assert_eq!(json_lines(&list).len(), 1);
    let gone = baton(&["history", "delete", "--conversation", "1", "--db", path(&db)], "").await;
    assert_eq!(gone.code, Some(0), "{}", gone.stderr);
    assert!(baton(&["history", "list", "--db", path(&db)], "").await.stdout.is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_killed_ask_leaves_an_interrupted_run_with_its_finished_step() {
    let s = server(TEST_KEY).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("history.sqlite");
    let pool = write_pool(dir.path(), &s, "", &[W("quick", "openai", "quick"), W("slow", "openai", "slow;ttfb=30000")]);
    let plan = dir.path().join("plan.txt");
    std::fs::write(&plan, "model_id = [0, 1]\nsubtasks = [\"First.\", \"Second.\"]\naccess_list = [[], [0]]").unwrap();
    let mut child = baton_tests::spawn_quiet(
        std::path::Path::new(env!("CARGO_BIN_EXE_baton")),
        &["ask", "--pool", path(&pool), "--plan", path(&plan), "--db", path(&db), "Crash me"],
    );
    // Wait until the history shows the first step finished (reading it while the run goes on
    // must leave the live run alone).
    let started = std::time::Instant::now();
    loop {
        assert!(started.elapsed() < Duration::from_secs(30), "the first step never finished");
        tokio::time::sleep(Duration::from_millis(100)).await;
        let show = baton(&["history", "show", "1", "--db", path(&db), "--json"], "").await;
        let Ok(tree) = serde_json::from_str::<Value>(show.stdout.trim()) else { continue };
        assert_eq!(tree["run"]["status"], "running", "a live run is not marked interrupted");
        if tree["steps"][0]["status"] == "finished" {
            break;
        }
    }
    // SIGKILL: no chance to clean up.
    child.start_kill().expect("kill -9");
    child.wait().await.expect("reaped");

    let show = baton(&["history", "show", "1", "--db", path(&db), "--json"], "").await;
    let tree: Value = serde_json::from_str(show.stdout.trim()).expect("the run");
    assert_eq!(tree["run"]["status"], "interrupted");
    assert_eq!(tree["steps"][0]["status"], "finished");
    assert_eq!(tree["steps"][0]["output"], "quick (saw 0 earlier answers) answers: First.");
    assert_eq!(tree["steps"][1]["status"], "interrupted");
    let list = baton(&["history", "list", "--db", path(&db), "--json"], "").await;
    assert_eq!(json_lines(&list)[0]["status"], "interrupted");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_damaged_history_stops_ask_before_any_call() {
    let s = server(TEST_KEY).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("history.sqlite");
    std::fs::write(&db, "not a database ".repeat(300)).unwrap();
    let pool = write_pool(dir.path(), &s, "", &[W("a", "openai", "a"), W("b", "openai", "b"), W("c", "openai", "c")]);
    let plan = fixture("chain-plan.txt");
    let out = baton(&["ask", "--pool", path(&pool), "--plan", path(&plan), "--db", path(&db), "Q"], TEST_KEY).await;
    assert_eq!(out.code, Some(2));
    assert!(out.stderr.contains("move it aside"), "{}", out.stderr);
    assert!(s.requests().is_empty(), "no provider was called");
    let out =
        baton(&["ask", "--pool", path(&pool), "--plan", path(&plan), "--db", path(&db), "--no-history", "Q"], TEST_KEY)
            .await;
    assert_eq!(out.code, Some(0), "--no-history still answers: {}", out.stderr);
}

/// A conductor whose chat template refuses two user turns in a row (as Mistral's, Gemma's and
/// many GGUF templates do) still plans the next question of a conversation whose last run
/// failed: the unanswered question reaches it followed by a turn saying what became of it.
#[tokio::test(flavor = "multi_thread")]
async fn a_follow_up_to_a_failed_run_gets_a_plan_from_a_conductor_that_needs_alternating_turns() {
    let s = server(TEST_KEY).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("history.sqlite");
    let model = dir.path().join("strict-conductor");
    let spec = baton_tinymodel::TinySpec { alternating_turns: true, ..Default::default() };
    baton_tinymodel::write_safetensors_model(&model, &spec).expect("write model");
    // Worker 0 refuses its first call (a 400, never retried): the first run fails.
    let workers = [W("a", "openai", "a;fail=400x1"), W("b", "openai", "b"), W("c", "openai", "c")];
    let conductor = format!(
        "[conductor]\nmodel = \"{}\"\ndevice = \"cpu\"\nmax_reasoning_chars = 24\nmax_subtask_chars = 16\ntemperature = 1.0\n",
        model.display()
    );
    let pool = write_pool(dir.path(), &s, &conductor, &workers);
    let plan = dir.path().join("plan.txt");
    std::fs::write(&plan, "model_id = [0]\nsubtasks = [\"Answer.\"]\naccess_list = [[]]").unwrap();

    let first = baton(
        &["ask", "--pool", path(&pool), "--plan", path(&plan), "--db", path(&db), "What is 6 times 7?"],
        TEST_KEY,
    )
    .await;
    assert_eq!(first.code, Some(1), "the first run fails: {}", first.stderr);
    let again = baton(
        &["ask", "--pool", path(&pool), "--db", path(&db), "--conversation", "1", "--json", "Try again."],
        TEST_KEY,
    )
    .await;
    assert_eq!(again.code, Some(0), "{}", again.stderr);
    let events = json_lines(&again);
    assert!(events.iter().any(|e| e["type"] == "plan_ready"), "the conductor wrote a plan: {}", again.stdout);
    assert_eq!(events.last().map(|e| e["type"].clone()), Some(Value::from("run_finished")), "{}", again.stdout);
}

/// While `baton ask` records a run, `baton history delete` refuses it (and its conversation)
/// and says what to do; once the run is stopped, its step keeps the text that had streamed,
/// `history show` prints it marked as cut short, and the run can be deleted.
#[tokio::test(flavor = "multi_thread")]
async fn a_run_in_progress_cannot_be_deleted_and_a_stopped_one_keeps_its_partial_answer() {
    use tokio::io::AsyncBufReadExt;

    let s = server(TEST_KEY).await;
    s.queue_replies("slow", ["Short wavelengths scatter more than long ones, which is why the sky looks blue to us."]);
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("history.sqlite");
    let pool = write_pool(dir.path(), &s, "", &[W("slow", "openai", "slow;latency=8000")]);
    let plan = dir.path().join("plan.txt");
    std::fs::write(&plan, "model_id = [0]\nsubtasks = [\"Explain.\"]\naccess_list = [[]]").unwrap();
    let args = ["ask", "--json", "--pool", path(&pool), "--plan", path(&plan), "--db", path(&db), "Why blue?"];
    let mut child = baton_tests::spawn_with_stdout(
        std::path::Path::new(env!("CARGO_BIN_EXE_baton")),
        &args,
        std::process::Stdio::piped(),
    );
    let mut lines = tokio::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut streamed = String::new();
    let mut deltas = 0;
    while deltas < 3 {
        let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await
            .expect("the answer streams")
            .expect("read")
            .expect("a line");
        let event: Value = serde_json::from_str(&line).expect("an event");
        if event["type"] == "step_delta" {
            streamed.push_str(event["text"].as_str().expect("text"));
            deltas += 1;
        }
    }

    let refused = baton(&["history", "delete", "1", "--db", path(&db)], "").await;
    assert_eq!(refused.code, Some(2), "{}", refused.stderr);
    assert!(refused.stderr.contains("run 1 is still going; stop it first, then delete it"), "{}", refused.stderr);
    let refused = baton(&["history", "delete", "--conversation", "1", "--db", path(&db)], "").await;
    assert_eq!(refused.code, Some(2), "{}", refused.stderr);
    assert!(refused.stderr.contains("stop it first, then delete the conversation"), "{}", refused.stderr);

    let pid = child.id().expect("pid").to_string();
    assert!(std::process::Command::new("kill").args(["-INT", &pid]).status().expect("kill").success());
    while lines.next_line().await.ok().flatten().is_some() {}
    let status = tokio::time::timeout(Duration::from_secs(10), child.wait()).await.expect("exits").expect("status");
    assert_eq!(status.code(), Some(130));

    let show = baton(&["history", "show", "1", "--db", path(&db)], "").await;
    assert_eq!(show.code, Some(0), "{}", show.stderr);
    assert!(show.stdout.contains("### Step 0 · slow (cancelled"), "{}", show.stdout);
    let kept = show
        .stdout
        .split("Subtask: Explain.\n\n")
        .nth(1)
        .and_then(|rest| rest.split("\n\n*(cut short: the run stopped while this step was answering)*").next())
        .unwrap_or_else(|| panic!("the partial answer, marked: {}", show.stdout));
    assert!(kept.starts_with(streamed.trim_end()), "{kept:?} keeps {streamed:?}");
    let deleted = baton(&["history", "delete", "1", "--db", path(&db)], "").await;
    assert_eq!(deleted.code, Some(0), "stopped, it can go: {}", deleted.stderr);
}

/// The history keeps each text once, yet gives back exactly what happened: for a run with a
/// retried step and a round of its own (a step given to the conductor, whose round is sent the
/// work before it), `history show --json` has the very events `ask --json` printed, deltas
/// and the version of each printed line aside, field for field and in order.
#[tokio::test(flavor = "multi_thread")]
async fn the_history_gives_back_the_events_a_run_printed() {
    let s = server(TEST_KEY).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("history.sqlite");
    let conductor = format!(
        "[conductor]\nurl = \"{}\"\nmodel = \"big-conductor\"\napi_key_env = \"BATON_E2E_KEY\"\n\n[recursion]\nenabled = true\nmax_depth = 1\n",
        s.base_url(baton_testserver::Wire::OpenAi)
    );
    let pool =
        write_pool(dir.path(), &s, &conductor, &[W("gpt", "openai", "gpt;fail=429x1"), W("claude", "anthropic", "c")]);
    let first = "```python\nmodel_id = [0, 1, 2]\nsubtasks = [\"Draft.\", \"Review.\", \"Improve the draft.\"]\naccess_list = [[], \"all\", \"all\"]\n```";
    let second =
        "```python\nmodel_id = [1, 0]\nsubtasks = [\"Polish it.\", \"Check.\"]\naccess_list = [\"all\", \"all\"]\n```";
    s.queue_replies("big-conductor", [first, second]);
    let out = baton(&["ask", "--json", "--pool", path(&pool), "--db", path(&db), "What is 2+2?"], TEST_KEY).await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    // Compared as JSON values: a printed line carries its `version` and may order its fields
    // otherwise.
    let printed: Vec<Value> = json_lines(&out)
        .into_iter()
        .filter(|e| e["type"] != "step_delta" && e["type"] != "plan_delta")
        .map(|mut e| {
            assert_eq!(e.as_object_mut().and_then(|e| e.remove("version")), Some(1.into()), "{e}");
            e
        })
        .collect();
    assert!(printed.iter().any(|e| e["type"] == "step_retrying"), "a retry");
    assert!(printed.iter().any(|e| e["round"] == 1), "a second round");

    let show = baton(&["history", "show", "1", "--db", path(&db), "--json"], "").await;
    assert_eq!(show.code, Some(0), "{}", show.stderr);
    let tree: Value = serde_json::from_str(show.stdout.trim()).expect("one JSON object");
    let stored: &Vec<Value> = tree["events"].as_array().expect("events");
    assert_eq!(stored, &printed);
}

/// `baton history workers`: per worker, calls (a step that never ran is none), failures,
/// latency, tokens and dollars as the steps recorded them, and the accuracy alone from the
/// newest evaluation that ran the worker.
#[tokio::test(flavor = "multi_thread")]
async fn worker_figures_add_up_the_history() {
    let s = server(TEST_KEY).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("history.sqlite");
    // `bad` refuses every call with a 400 (never retried); the judge needs its answer, so it
    // never runs.
    let workers = [W("good", "openai", "good;reply=It_is_42"), W("bad", "anthropic", "bad;fail=400x*")];
    let pool = write_pool(dir.path(), &s, "", &workers);
    let priced = std::fs::read_to_string(&pool).unwrap().replace(
        "api_key_env = \"BATON_E2E_KEY\"\n",
        "api_key_env = \"BATON_E2E_KEY\"\nprice_in = 1.0\nprice_out = 2.0\n",
    );
    std::fs::write(&pool, priced).unwrap();
    let plan = dir.path().join("plan.txt");
    std::fs::write(
        &plan,
        "model_id = [0, 1, 0]\nsubtasks = [\"A.\", \"B.\", \"Judge.\"]\naccess_list = [[], [], \"all\"]",
    )
    .unwrap();
    for q in ["First?", "Second?"] {
        let out = baton(&["ask", "--pool", path(&pool), "--plan", path(&plan), "--db", path(&db), q], TEST_KEY).await;
        assert_eq!(out.code, Some(1), "the run fails with its step: {}", out.stderr);
    }
    let suite = dir.path().join("two.jsonl");
    std::fs::write(
        &suite,
        "{\"id\":\"a\",\"question\":\"Six times seven?\",\"answer\":\"42\",\"kind\":\"number\"}\n\
         {\"id\":\"b\",\"question\":\"Three plus four?\",\"answer\":\"7\",\"kind\":\"number\"}\n",
    )
    .unwrap();
    let eval = baton(
        &[
            "eval",
            "run",
            path(&suite),
            "--pool",
            path(&pool),
            "--db",
            path(&db),
            "--strategies",
            "single:good",
            "--id",
            "e1",
        ],
        TEST_KEY,
    )
    .await;
    assert_eq!(eval.code, Some(0), "{}", eval.stderr);

    let out = baton(&["history", "workers", "--db", path(&db), "--json"], "").await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let figures = json_lines(&out);
    let names: Vec<&str> = figures.iter().map(|f| f["worker"].as_str().unwrap()).collect();
    assert_eq!(names, ["good", "bad"], "most called first");
    let (good, bad) = (&figures[0], &figures[1]);
    // Two questions' first step, and the evaluation's two items.
    assert_eq!(
        (good["calls"].as_u64(), good["finished"].as_u64(), good["failed"].as_u64()),
        (Some(4), Some(4), Some(0))
    );
    assert_eq!(good["failure_rate"], 0.0);
    assert_eq!(
        (bad["calls"].as_u64(), bad["failed"].as_u64(), bad["failure_rate"].as_f64()),
        (Some(2), Some(2), Some(1.0))
    );
    assert!(good["latency_p50_ms"].is_u64() && good["latency_p95_ms"].as_u64() >= good["latency_p50_ms"].as_u64());
    assert!(bad["latency_p50_ms"].is_null(), "no call of bad finished");

    // Tokens and dollars are the sums of what the steps recorded.
    let mut tokens = (0, 0);
    let mut cost = 0.0;
    let list = baton(&["history", "list", "--db", path(&db), "--json", "--limit", "100"], "").await;
    let mut ids: Vec<i64> = json_lines(&list).iter().map(|r| r["id"].as_i64().unwrap()).collect();
    // The evaluation's runs stay out of the list; they are found through its results.
    let export = dir.path().join("export");
    let out = baton(&["eval", "export", "e1", "-o", path(&export), "--db", path(&db)], "").await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let results = std::fs::read_to_string(export.join("e1.results.jsonl")).expect("results");
    ids.extend(results.lines().map(|l| serde_json::from_str::<Value>(l).unwrap()["run_id"].as_i64().unwrap()));
    assert_eq!(ids.len(), 4);
    for id in ids {
        let show = baton(&["history", "show", &id.to_string(), "--db", path(&db), "--json"], "").await;
        let tree: Value = serde_json::from_str(show.stdout.trim()).expect("run");
        for step in
            tree["steps"].as_array().unwrap().iter().filter(|s| s["worker"] == "good" && s["status"] == "finished")
        {
            tokens.0 += step["input_tokens"].as_u64().unwrap();
            tokens.1 += step["output_tokens"].as_u64().unwrap();
            cost += step["cost_usd"].as_f64().unwrap();
        }
    }
    assert_eq!((good["input_tokens"].as_u64(), good["output_tokens"].as_u64()), (Some(tokens.0), Some(tokens.1)));
    assert!((good["cost_usd"].as_f64().unwrap() - cost).abs() < 1e-12 && cost > 0.0, "{good} vs {cost}");
    assert_eq!(good["cost_complete"], true);

    // Right on "42" only: half the evaluation's items.
    assert_eq!(good["evaluation"]["evaluation_id"], "e1");
    assert_eq!((good["evaluation"]["accuracy"].as_f64(), good["evaluation"]["n"].as_u64()), (Some(0.5), Some(2)));
    assert!(bad["evaluation"].is_null());

    let table = baton(&["history", "workers", "--db", path(&db)], "").await;
    let first = table.stdout.lines().nth(1).unwrap_or_default();
    assert!(first.starts_with("good") && first.contains("50.0% of 2"), "{}", table.stdout);
    assert!(table.stdout.lines().nth(2).is_some_and(|l| l.contains("2 (100.0%)")), "{}", table.stdout);
}
