//! The shell's commands through Tauri's IPC on the mock runtime (no window): the real
//! capabilities, real files, a real SQLite history and a loopback provider server.

#[path = "support/harness.rs"]
mod harness;

use harness::{Harness, app, conductor, invoke, invoke_in, worker};
use serde_json::{Value, json};

#[test]
fn a_new_user_has_no_pool_and_no_conductor() {
    let dir = tempfile::tempdir().unwrap();
    let h = app(dir.path(), "main");
    let s = invoke(&h, "get_settings", json!({})).unwrap();
    assert_eq!(s["pool_exists"], false);
    assert_eq!(s["conductor_configured"], false);
    assert_eq!(s["form"]["workers"], json!([]));
    assert_eq!(s["workers"], json!([]));
    // No pool yet is how everyone starts, not a problem to show in red.
    assert_eq!(s["pool_error"], Value::Null, "{s}");
    assert_eq!(s["conductor_needed"], true);

    // A pool that routes every question by what it learned runs without a conductor.
    let pool = "[conductor]\nroute = \"always\"\n\n[[worker]]\nname = \"a\"\nprovider = \"openai-compatible\"\nmodel = \"m\"\nbase_url = \"http://127.0.0.1:9/v1\"\n";
    std::fs::write(dir.path().join("pool.toml"), pool).unwrap();
    let s = invoke(&h, "get_settings", json!({})).unwrap();
    assert_eq!(
        (&s["pool_error"], &s["conductor_configured"], &s["conductor_needed"]),
        (&Value::Null, &json!(false), &json!(false)),
        "{s}"
    );
}

#[test]
fn settings_are_saved_to_the_pool_file_and_bad_fields_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let h = app(dir.path(), "main");
    let form = json!({ "workers": [worker("w", "m", "http://127.0.0.1:9/v1")], "conductor": conductor() });
    let s = invoke(&h, "save_settings", json!({ "form": form })).unwrap();
    assert_eq!(s["pool_error"], Value::Null, "{s}");
    assert_eq!(s["workers"][0]["name"], "w");
    let text = std::fs::read_to_string(dir.path().join("pool.toml")).unwrap();
    assert!(text.contains("base_url = \"http://127.0.0.1:9/v1\""), "{text}");

    let mut bad = worker("w", "m", "");
    bad["base_url"] = Value::Null;
    let err =
        invoke(&h, "save_settings", json!({ "form": { "workers": [bad], "conductor": conductor() } })).unwrap_err();
    assert_eq!(err["kind"], "bad_input", "{err}");
    assert!(err["message"].as_str().unwrap().contains("base_url"), "{err}");
    // Nothing was written: the good pool is still there.
    assert_eq!(std::fs::read_to_string(dir.path().join("pool.toml")).unwrap(), text);
}

#[test]
fn errors_cross_as_kind_and_message() {
    let dir = tempfile::tempdir().unwrap();
    let h = app(dir.path(), "main");
    let err = invoke(&h, "get_run", json!({ "id": 42 })).unwrap_err();
    assert_eq!(err, json!({ "kind": "not_found", "message": "there is no run 42 in the history" }));
    let err = invoke(
        &h,
        "ask",
        json!({
            "request": { "question": "hi", "conversation_id": null, "workers": null, "plan": null },
            "onEvent": "__CHANNEL__:1", "stopId": "run-1",
        }),
    )
    .unwrap_err();
    assert_eq!(err["kind"], "pool", "{err}");
    assert!(err["message"].as_str().unwrap().contains("no such file"), "{err}");
    let err =
        invoke(&h, "set_key", json!({ "provider": "openai-compatible", "baseUrl": null, "key": "k" })).unwrap_err();
    assert_eq!(err["kind"], "bad_input");
}

#[test]
fn a_window_without_the_capability_cannot_call_commands() {
    let dir = tempfile::tempdir().unwrap();
    let h = app(dir.path(), "intruder");
    let err = invoke(&h, "get_settings", json!({})).unwrap_err();
    assert!(err.to_string().contains("not allowed"), "{err}");
}

#[test]
fn a_reviewed_plan_runs_over_loopback_and_is_recorded() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let server = rt.block_on(baton_testserver::TestServer::start()).unwrap();
    let base = server.base_url(baton_testserver::Wire::OpenAi);
    let dir = tempfile::tempdir().unwrap();
    let h = app(dir.path(), "main");
    let form = json!({
        "workers": [worker("a", "a;reply=first", &base), worker("b", "b;reply=second", &base)],
        "conductor": conductor(),
    });
    invoke(&h, "save_settings", json!({ "form": form })).unwrap();
    let plan = json!({ "model_id": [0, 1], "subtasks": ["draft", "finish"], "access_list": [[], "all"] });
    invoke(&h, "validate_plan", json!({ "plan": plan, "workers": null })).unwrap();
    let bad = json!({ "model_id": [0, 5], "subtasks": ["x", "y"], "access_list": [[], []] });
    let err = invoke(&h, "validate_plan", json!({ "plan": bad, "workers": null })).unwrap_err();
    assert_eq!(err["kind"], "bad_input");

    let result = invoke(
        &h,
        "ask",
        json!({
            "request": { "question": "q?", "conversation_id": null, "workers": null, "plan": plan },
            "onEvent": "__CHANNEL__:7", "stopId": "run-7",
        }),
    )
    .unwrap();
    assert_eq!(result["status"], "finished", "{result}");
    let run = invoke(&h, "get_run", json!({ "id": result["run_id"] })).unwrap();
    assert_eq!(run["run"]["answer"], "second");
    assert_eq!(run["steps"][1]["worker"], "b");
    let events: Vec<baton_engine::RunEvent> = serde_json::from_value(run["events"].clone()).unwrap();
    baton_engine::event::check_sequence(&events).unwrap();

    // Only the second worker for this conversation: the plan's "Model 0" is now b.
    let one = json!({ "model_id": [0], "subtasks": ["only"], "access_list": [[]] });
    let follow = invoke(&h, "ask", json!({
        "request": { "question": "again", "conversation_id": result["conversation_id"], "workers": [1], "plan": one },
        "onEvent": "__CHANNEL__:8", "stopId": "run-8",
    }))
    .unwrap();
    let runs = invoke(&h, "conversation_runs", json!({ "id": result["conversation_id"] })).unwrap();
    assert_eq!(runs.as_array().unwrap().len(), 2);
    assert_eq!(runs[1]["run"]["answer"], "second");
    assert_eq!(runs[1]["run"]["id"], follow["run_id"]);
    let hits = invoke(&h, "search_history", json!({ "query": "again" })).unwrap();
    assert_eq!(hits[0]["id"], follow["run_id"]);

    // The conversation keeps its choices, by worker name.
    let choices = json!({ "id": result["conversation_id"], "workers": ["b"], "review": true });
    invoke(&h, "set_conversation_choices", choices).unwrap();
    let conversations = invoke(&h, "list_conversations", json!({ "before": null })).unwrap();
    assert_eq!((&conversations[0]["workers"], &conversations[0]["review"]), (&json!(["b"]), &json!(true)));
    let one = invoke(&h, "get_conversation", json!({ "id": result["conversation_id"] })).unwrap();
    assert_eq!(one, conversations[0]);
    assert_eq!(invoke(&h, "get_conversation", json!({ "id": 999 })).unwrap_err()["kind"], "not_found");
    let none = invoke(&h, "set_conversation_choices", json!({ "id": 999, "workers": null, "review": false }));
    assert_eq!(none.unwrap_err()["kind"], "not_found");
    let empty = json!({ "id": result["conversation_id"], "workers": [], "review": false });
    assert_eq!(invoke(&h, "set_conversation_choices", empty).unwrap_err()["kind"], "bad_input");

    let target = json!({ "kind": "run", "id": result["run_id"] });
    let written = invoke(&h, "export_history", json!({ "target": target, "format": "markdown" })).unwrap();
    let out = dir.path().join("saved").join(format!("baton-run-{}.md", result["run_id"]));
    assert_eq!(written, json!(out.display().to_string()), "written where the save dialog said");
    assert!(std::fs::read_to_string(&out).unwrap().contains("q?"));
    invoke(&h, "delete_conversation", json!({ "id": result["conversation_id"] })).unwrap();
    assert_eq!(invoke(&h, "list_runs", json!({ "before": null })).unwrap(), json!([]));
}

#[test]
fn one_step_of_a_finished_run_is_rerun_with_another_worker() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let server = rt.block_on(baton_testserver::TestServer::start()).unwrap();
    let base = server.base_url(baton_testserver::Wire::OpenAi);
    let dir = tempfile::tempdir().unwrap();
    let h = app(dir.path(), "main");
    let workers = [
        worker("a", "a;reply=facts", &base),
        worker("b", "b;reply=weak_draft", &base),
        worker("c", "c;reply=strong_draft", &base),
    ];
    invoke(&h, "save_settings", json!({ "form": { "workers": workers, "conductor": conductor() } })).unwrap();
    // The conversation uses workers a and b only; the plan's "Model 1" is b.
    let plan =
        json!({ "model_id": [0, 1, 0], "subtasks": ["gather", "draft", "polish"], "access_list": [[], [0], [1]] });
    let first = invoke(
        &h,
        "ask",
        json!({
            "request": { "question": "q?", "conversation_id": null, "workers": [0, 1], "plan": plan },
            "onEvent": "__CHANNEL__:1", "stopId": "run-1",
        }),
    )
    .unwrap();
    assert_eq!(first["status"], "finished", "{first}");
    let before = server.requests().len();

    // Step 1 again with c, which this run did not have: steps 1 and 2 are called.
    let again = invoke(
        &h,
        "rerun_step",
        json!({
            "request": { "run_id": first["run_id"], "step": 1, "worker": "c" },
            "onEvent": "__CHANNEL__:2", "stopId": "run-2",
        }),
    )
    .unwrap();
    assert_eq!(again["status"], "finished", "{again}");
    assert_eq!(again["conversation_id"], first["conversation_id"]);
    let calls: Vec<String> = server.requests()[before..].iter().map(|r| r.model.clone()).collect();
    assert_eq!(calls, ["c;reply=strong_draft", "a;reply=facts"]);
    let run = invoke(&h, "get_run", json!({ "id": again["run_id"] })).unwrap();
    let old = invoke(&h, "get_run", json!({ "id": first["run_id"] })).unwrap();
    assert_eq!(run["run"]["rerun_of"], json!({ "run_id": old["run"]["uid"], "step": 1 }));
    assert_eq!(run["steps"][0]["reused_from"], old["run"]["uid"]);
    assert_eq!(run["steps"][1]["worker"], "c");
    assert_eq!(run["steps"][2]["request"]["messages"][1]["content"], "strong draft");
    let names: Vec<&str> =
        run["run"]["workers"].as_array().unwrap().iter().map(|w| w["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["a", "b", "c"]);

    // Clear refusals: a step the plan lacks, a worker the pool lacks, a run that does not exist.
    let rerun = |run: &Value, step: u32, worker: &str| {
        invoke(
            &h,
            "rerun_step",
            json!({
                "request": { "run_id": run, "step": step, "worker": worker },
                "onEvent": "__CHANNEL__:3", "stopId": "run-3",
            }),
        )
        .unwrap_err()
    };
    let err = rerun(&first["run_id"], 7, "a");
    assert_eq!(err, json!({ "kind": "bad_input", "message": "the run has no step 7; its plan has 3 steps" }));
    let err = rerun(&first["run_id"], 0, "zed");
    assert_eq!(err, json!({ "kind": "not_found", "message": "there is no worker named \"zed\" in the pool" }));
    assert_eq!(rerun(&json!(999), 0, "a")["kind"], "not_found");
    // A run that is gone is the answer before a broken pool file; a run that is there needs it.
    std::fs::write(dir.path().join("pool.toml"), "[[worker]\n").unwrap();
    assert_eq!(rerun(&json!(999), 0, "a")["kind"], "not_found");
    assert_eq!(rerun(&first["run_id"], 1, "c")["kind"], "pool");
}

/// An app whose conductor is a loopback server that takes ten seconds to answer at all.
struct SlowConductor {
    _runtime: tokio::runtime::Runtime,
    server: baton_testserver::TestServer,
    _dir: tempfile::TempDir,
    h: Harness,
}

impl SlowConductor {
    fn new() -> SlowConductor {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let server = runtime.block_on(baton_testserver::TestServer::start()).unwrap();
        let base = server.base_url(baton_testserver::Wire::OpenAi);
        let dir = tempfile::tempdir().unwrap();
        let h = app(dir.path(), "main");
        let mut conductor = conductor();
        conductor["url"] = json!(base);
        conductor["model"] = json!("planner;ttfb=10000");
        let form = json!({ "workers": [worker("a", "a", &base)], "conductor": conductor });
        invoke(&h, "save_settings", json!({ "form": form })).unwrap();
        SlowConductor { _runtime: runtime, server, _dir: dir, h }
    }

    /// Invokes `command` on another thread and returns once it has asked the conductor.
    fn start(&self, command: &'static str, args: Value) -> std::thread::JoinHandle<Result<Value, Value>> {
        let started = std::time::Instant::now();
        let window = self.h.window.clone();
        let call = std::thread::spawn(move || invoke_in(&window, command, args));
        while self.server.requests().is_empty() {
            assert!(started.elapsed().as_secs() < 10, "the conductor was never asked");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        call
    }
}

#[test]
fn a_plan_being_drafted_stops_when_cancelled() {
    let slow = SlowConductor::new();
    let h = &slow.h;
    let started = std::time::Instant::now();
    let drafting = slow.start(
        "draft_plan",
        json!({
            "question": "q?", "conversationId": null, "workers": null,
            "draftId": "draft-1", "onDelta": "__CHANNEL__:4",
        }),
    );
    assert_eq!(invoke(h, "cancel_run", json!({ "runId": "draft-1" })).unwrap(), json!(true));
    let err = drafting.join().unwrap().unwrap_err();
    assert_eq!(err["kind"], "cancelled", "{err}");
    assert!(started.elapsed().as_secs() < 5, "stopped long before the server answered: {:?}", started.elapsed());
    assert_eq!(invoke(h, "cancel_run", json!({ "runId": "draft-1" })).unwrap(), json!(false), "forgotten once over");
}

#[test]
fn a_run_stops_by_the_id_the_window_gave_it() {
    // No step has started when the run is stopped: the conductor is still writing the plan.
    let slow = SlowConductor::new();
    let h = &slow.h;
    let started = std::time::Instant::now();
    let question = json!({ "question": "q?", "conversation_id": null, "workers": null, "plan": null });
    let asking = slow.start("ask", json!({ "request": question, "stopId": "live-1", "onEvent": "__CHANNEL__:5" }));
    // The same id cannot start a second piece of work while the first goes on.
    let twice = invoke(h, "ask", json!({ "request": question, "stopId": "live-1", "onEvent": "__CHANNEL__:6" }));
    assert_eq!(twice.unwrap_err()["kind"], "bad_input");
    assert_eq!(invoke(h, "cancel_run", json!({ "runId": "live-1" })).unwrap(), json!(true));
    let result = asking.join().unwrap().unwrap();
    assert_eq!(result["status"], "cancelled", "{result}");
    assert!(started.elapsed().as_secs() < 5, "stopped long before the server answered: {:?}", started.elapsed());
    assert_eq!(invoke(h, "get_run", json!({ "id": result["run_id"] })).unwrap()["run"]["status"], "cancelled");
    assert_eq!(invoke(h, "cancel_run", json!({ "runId": "live-1" })).unwrap(), json!(false), "forgotten once over");
}

/// Runs `command` on another thread and fails the test unless it answers within `secs`.
fn answers_within(h: &Harness, secs: u64, command: &'static str, args: Value) -> Result<Value, Value> {
    let window = h.window.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(invoke_in(&window, command, args));
    });
    rx.recv_timeout(std::time::Duration::from_secs(secs))
        .unwrap_or_else(|_| panic!("{command} waited for the model being loaded"))
}

#[test]
fn nothing_waits_on_a_model_load_and_a_save_keeps_a_model_whose_settings_did_not_change() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let server = rt.block_on(baton_testserver::TestServer::start()).unwrap();
    let base = server.base_url(baton_testserver::Wire::OpenAi);
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("conductor");
    baton_tinymodel::write_safetensors_model(&model, &baton_tinymodel::TinySpec::default()).unwrap();
    // The conductor's chat template is a named pipe: loading the model reads it, and so takes
    // exactly as long as this test keeps the pipe's other end closed (a 7B model on a CPU
    // takes minutes).
    let template = dir.path().join("template.jinja");
    assert!(std::process::Command::new("mkfifo").arg(&template).status().unwrap().success());
    let h = app(dir.path(), "main");
    let mut c = conductor();
    c["model"] = json!(model);
    c["device"] = json!("cpu");
    let form = json!({ "workers": [worker("w", "w;reply=fine", &base)], "conductor": c });
    invoke(&h, "save_settings", json!({ "form": form })).unwrap();
    let pool = dir.path().join("pool.toml");
    let text = std::fs::read_to_string(&pool).unwrap();
    let text = text.replace("[conductor]\n", &format!("[conductor]\nchat_template = {:?}\n", template.display()));
    std::fs::write(&pool, text).unwrap();

    let window = h.window.clone();
    let loading = std::thread::spawn(move || invoke_in(&window, "load_conductor", json!({})));
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert!(!loading.is_finished(), "the load should be waiting on the template");

    // While it loads: a settings save, a plan check, a connection test and a reviewed plan's run.
    let mut f = invoke(&h, "get_settings", json!({})).unwrap()["form"].clone();
    f["workers"][0]["description"] = json!("changed while the conductor loads");
    answers_within(&h, 10, "save_settings", json!({ "form": f })).unwrap();
    let plan = json!({ "model_id": [0], "subtasks": ["x"], "access_list": [[]] });
    answers_within(&h, 10, "validate_plan", json!({ "plan": plan, "workers": null })).unwrap();
    let test = answers_within(&h, 10, "test_worker", json!({ "index": 0, "stopId": "t" })).unwrap();
    assert_eq!(test["reply"], "fine");
    let request = json!({ "question": "q", "conversation_id": null, "workers": null, "plan": plan });
    let run = answers_within(&h, 20, "ask", json!({ "request": request, "stopId": "r", "onEvent": "__CHANNEL__:1" }));
    assert_eq!(run.unwrap()["status"], "finished");

    // Let the load finish.
    std::fs::write(&template, baton_tinymodel::CHATML_TEMPLATE).unwrap();
    let described = loading.join().unwrap().expect("the conductor loads");
    assert!(described.as_str().unwrap().contains("conductor"), "{described}");
    assert!(h.state().models.is_loaded(&model));

    // A save that changes nothing about the conductor keeps it loaded; one that does drops it.
    let mut f = invoke(&h, "get_settings", json!({})).unwrap()["form"].clone();
    f["workers"][0]["description"] = json!("changed again");
    invoke(&h, "save_settings", json!({ "form": f.clone() })).unwrap();
    assert!(h.state().models.is_loaded(&model), "nothing about the conductor changed");
    f["conductor"]["device"] = json!("auto");
    invoke(&h, "save_settings", json!({ "form": f })).unwrap();
    assert!(!h.state().models.is_loaded(&model), "the conductor's device changed: loaded afresh next time");
}

/// The Evaluate screen's commands over IPC: an evaluation of two scripted workers on eight
/// MMLU items, its report and results, its runs kept out of the chat's list, the HTML export
/// where the save dialog says, and delete.
#[test]
fn an_evaluation_runs_through_the_commands_and_is_kept() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let server = rt.block_on(baton_testserver::TestServer::start()).unwrap();
    let base = server.base_url(baton_testserver::Wire::OpenAi);
    let dir = tempfile::tempdir().unwrap();
    let h = app(dir.path(), "main");
    let form = json!({
        "workers": [worker("a", "a;reply=Answer:_B", &base), worker("b", "b;reply=Answer:_A", &base)],
        "conductor": conductor(),
    });
    invoke(&h, "save_settings", json!({ "form": form })).unwrap();
    let suites = invoke(&h, "eval_suites", json!({})).unwrap();
    assert!(suites.as_array().unwrap().iter().any(|s| s["name"] == "mmlu" && s["items"] == 285), "{suites}");

    let request = json!({ "suite": "mmlu", "strategies": ["single:a", "single:b", "oracle"], "limit": 8, "max_cost_usd": null, "id": "ipc" });
    let view =
        invoke(&h, "run_evaluation", json!({ "request": request, "stopId": "eval-1", "onProgress": "__CHANNEL__:9" }))
            .unwrap();
    assert_eq!(view["evaluation"]["status"], "finished", "{view}");
    let answers: std::collections::HashMap<String, String> =
        baton_eval::suite::load("mmlu").unwrap().items.into_iter().map(|i| (i.id, i.answer)).collect();
    let results = view["results"].as_array().unwrap();
    assert_eq!(results.len(), 24);
    for r in results {
        let answer = &answers[r["item_id"].as_str().unwrap()];
        let right = match r["strategy"].as_str().unwrap() {
            "single:a" => answer == "B",
            "single:b" => answer == "A",
            _ => answer == "A" || answer == "B",
        };
        assert_eq!(r["correct"], right, "{r}");
        assert!(r["run_id"].is_number(), "each result opens its run: {r}");
    }
    let names: Vec<&str> =
        view["report"]["strategies"].as_array().unwrap().iter().map(|s| s["strategy"].as_str().unwrap()).collect();
    assert_eq!(names, ["single:a", "single:b", "oracle"]);
    let run = invoke(&h, "get_run", json!({ "id": results[0]["run_id"] })).unwrap();
    assert!(run["run"]["question"].as_str().unwrap().contains("Answer: <letter>"));
    assert_eq!(invoke(&h, "list_conversations", json!({ "before": null })).unwrap(), json!([]), "kept out of the chat");

    // The Workers & keys screen's records: each worker's 8 calls, and its accuracy alone.
    let figures = invoke(&h, "worker_figures", json!({})).unwrap();
    for (name, strategy) in [("a", "single:a"), ("b", "single:b")] {
        let f = figures.as_array().unwrap().iter().find(|f| f["worker"] == name).expect(name);
        let accuracy = view["report"]["strategies"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["strategy"] == strategy)
            .unwrap()["accuracy"]
            .clone();
        assert_eq!((f["calls"].as_u64(), f["failed"].as_u64()), (Some(8), Some(0)), "{f}");
        assert_eq!(
            (&f["evaluation"]["evaluation_id"], &f["evaluation"]["accuracy"]),
            (&json!("ipc"), &accuracy),
            "{f}"
        );
    }

    let list = invoke(&h, "list_evaluations", json!({})).unwrap();
    assert_eq!(list[0]["id"], "ipc");
    assert_eq!(invoke(&h, "get_evaluation", json!({ "id": "ipc" })).unwrap(), view);
    let written = invoke(&h, "export_evaluation", json!({ "id": "ipc" })).unwrap();
    let out = dir.path().join("saved").join("baton-evaluation-ipc.html");
    assert_eq!(written, json!(out.display().to_string()));
    assert!(std::fs::read_to_string(&out).unwrap().contains("<svg"));
    let bad = json!({ "suite": "mmlu", "strategies": ["single:zed"], "limit": 2, "max_cost_usd": null, "id": null });
    let err =
        invoke(&h, "run_evaluation", json!({ "request": bad, "stopId": "eval-2", "onProgress": "__CHANNEL__:10" }))
            .unwrap_err();
    assert_eq!(err["kind"], "bad_input");
    // The screen's advanced settings reach the harness.
    let twice = json!({
        "suite": "mmlu", "strategies": ["single:a"], "limit": 2, "max_cost_usd": null, "id": "rep",
        "repeats": 2, "concurrency": 1, "calibration": null, "seed": 7,
    });
    let view =
        invoke(&h, "run_evaluation", json!({ "request": twice, "stopId": "eval-3", "onProgress": "__CHANNEL__:11" }))
            .unwrap();
    let repeats: Vec<u64> = view["results"].as_array().unwrap().iter().map(|r| r["repeat"].as_u64().unwrap()).collect();
    assert_eq!(repeats.iter().filter(|r| **r == 1).count(), 2, "2 items, each twice: {repeats:?}");
    assert_eq!(
        (&view["evaluation"]["config"]["repeats"], &view["evaluation"]["config"]["seed"]),
        (&json!(2), &json!(7))
    );
    let none = json!({ "suite": "mmlu", "strategies": ["single:a"], "limit": 2, "max_cost_usd": null, "id": null, "repeats": 0 });
    let err =
        invoke(&h, "run_evaluation", json!({ "request": none, "stopId": "eval-4", "onProgress": "__CHANNEL__:12" }))
            .unwrap_err();
    assert_eq!(err["kind"], "bad_input");
    invoke(&h, "delete_evaluation", json!({ "id": "rep" })).unwrap();
    invoke(&h, "delete_evaluation", json!({ "id": "ipc" })).unwrap();
    assert_eq!(invoke(&h, "list_evaluations", json!({})).unwrap(), json!([]));
    assert_eq!(invoke(&h, "delete_evaluation", json!({ "id": "ipc" })).unwrap_err()["kind"], "not_found");
}

/// Compare in chat: the conductor's plan and one worker alone answer the same question at the
/// same time; both runs are kept in the conversation, only the conductor's answer is a turn of
/// it, and the mark of the better answer is kept and exported as a preference pair.
#[test]
fn a_question_is_compared_with_one_worker_alone_and_the_mark_is_kept() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let server = rt.block_on(baton_testserver::TestServer::start()).unwrap();
    let base = server.base_url(baton_testserver::Wire::OpenAi);
    let dir = tempfile::tempdir().unwrap();
    let h = app(dir.path(), "main");
    // A conductor on the loopback server that plans every question about the sky the same way.
    let plans = dir.path().join("plans.json");
    let plan = "model_id = [0, 1]\nsubtasks = [\"Gather facts.\", \"Answer.\"]\naccess_list = [[], [0]]";
    std::fs::write(&plans, json!({ "sky": plan }).to_string()).unwrap();
    let mut remote = conductor();
    remote["url"] = json!(base);
    remote["model"] = json!(format!("cond;knows={}", plans.display()));
    let workers = [
        worker("a", "a;reply=facts", &base),
        worker("b", "b;reply=planned_answer", &base),
        worker("c", "c;reply=alone_answer", &base),
    ];
    invoke(&h, "save_settings", json!({ "form": { "workers": workers, "conductor": remote } })).unwrap();
    let compare = |question: &str, conversation: Value, worker: &str, n: u32| {
        invoke(
            &h,
            "ask_compared",
            json!({
                "request": { "question": question, "conversation_id": conversation, "workers": [0, 1], "worker": worker },
                "stopId": format!("cmp-{n}"), "onEvent": format!("__CHANNEL__:{}", 20 + 2 * n),
                "onSingle": format!("__CHANNEL__:{}", 21 + 2 * n),
            }),
        )
    };
    let first = compare("Why is the sky blue?", Value::Null, "c", 0).unwrap();
    assert_eq!((&first["conductor"]["status"], &first["single"]["status"]), (&json!("finished"), &json!("finished")));
    let conversation = first["conductor"]["conversation_id"].clone();
    assert!(conversation.is_number() && first["single"]["conversation_id"] == conversation, "{first}");
    let planned = invoke(&h, "get_run", json!({ "id": first["conductor"]["run_id"] })).unwrap();
    let alone = invoke(&h, "get_run", json!({ "id": first["single"]["run_id"] })).unwrap();
    assert_eq!(
        (&planned["run"]["answer"], &alone["run"]["answer"]),
        (&json!("planned answer"), &json!("alone answer"))
    );
    assert_eq!(
        (&alone["steps"][0]["worker"], &alone["steps"][0]["subtask"]),
        (&json!("c"), &json!("Why is the sky blue?"))
    );
    let listed = invoke(&h, "list_conversations", json!({ "before": null })).unwrap();
    assert_eq!((listed.as_array().unwrap().len(), &listed[0]["runs"]), (1, &json!(2)), "{listed}");

    // The follow-up: the worker alone is told the conversation so far, which holds the
    // conductor's answer, never its own.
    let second = compare("And the sky at sunset?", conversation.clone(), "c", 1).unwrap();
    let alone = invoke(&h, "get_run", json!({ "id": second["single"]["run_id"] })).unwrap();
    let subtask = alone["steps"][0]["subtask"].as_str().unwrap();
    assert!(subtask.contains("Assistant: planned answer") && subtask.ends_with("And the sky at sunset?"), "{subtask}");
    assert!(!subtask.contains("alone answer"), "{subtask}");

    let kept = invoke(&h, "conversation_comparisons", json!({ "id": conversation })).unwrap();
    assert_eq!(kept.as_array().unwrap().len(), 2);
    assert_eq!(
        (&kept[0]["conductor_run"], &kept[0]["single_run"]),
        (&first["conductor"]["run_id"], &first["single"]["run_id"])
    );
    assert_eq!((&kept[0]["worker"], &kept[0]["preferred"]), (&json!("c"), &Value::Null));
    let err = invoke(&h, "export_preferences", json!({})).unwrap_err();
    assert_eq!(err["kind"], "bad_input", "nothing marked yet: {err}");
    invoke(&h, "mark_comparison", json!({ "id": first["comparison_id"], "preferred": "single" })).unwrap();
    invoke(&h, "mark_comparison", json!({ "id": second["comparison_id"], "preferred": "tie" })).unwrap();
    let kept = invoke(&h, "conversation_comparisons", json!({ "id": conversation })).unwrap();
    assert_eq!((&kept[0]["preferred"], &kept[1]["preferred"]), (&json!("single"), &json!("tie")));
    // The marks add to c's profile (the Workers screen shows them; the conductor is told).
    let learning = invoke(&h, "pool_learning", json!({})).unwrap();
    let marks: Vec<&Value> = learning["workers"].as_array().unwrap().iter().map(|w| &w["marks"]).collect();
    assert_eq!(marks[2], &json!({ "better": 1, "tie": 1, "worse": 0 }), "{learning}");
    assert_eq!(marks[0], &json!({ "better": 0, "tie": 0, "worse": 0 }));
    assert_eq!(
        invoke(&h, "mark_comparison", json!({ "id": 999, "preferred": "single" })).unwrap_err()["kind"],
        "not_found"
    );
    let written = invoke(&h, "export_preferences", json!({})).unwrap();
    let text = std::fs::read_to_string(written.as_str().unwrap()).unwrap();
    let pairs: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(pairs.len(), 1, "a tie is no pair: {text}");
    assert_eq!(pairs[0]["chosen"], json!([{ "role": "assistant", "content": "alone answer" }]));
    assert_eq!(pairs[0]["rejected"], json!([{ "role": "assistant", "content": "planned answer" }]));

    let err = compare("Why is the sky blue?", Value::Null, "zed", 2).unwrap_err();
    assert_eq!(err["kind"], "not_found", "{err}");
}

/// The history's run list once it holds `n` runs and none of them is still running (at most 10 s).
fn recorded_runs(h: &Harness, n: usize) -> Value {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let runs = invoke(h, "list_runs", json!({ "before": null })).unwrap();
        let list = runs.as_array().unwrap();
        let settled = list.len() == n && list.iter().all(|r| r["status"] != "running");
        if settled || std::time::Instant::now() > deadline {
            assert!(settled, "the history did not settle on {n} ended runs: {runs}");
            return runs;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// The Local API: switched on from its screen, it serves the pool to an OpenAI client over
/// loopback with the app's conductor, history and token; its runs are in the app's history
/// with their topology; an edited pool shows as stale until a restart; switched off, the port
/// is closed; a port in use is a clear error kept for the screen.
#[test]
fn the_local_api_serves_the_pool_and_its_runs_are_in_the_history() {
    // Its token lives in the keychain.
    if !baton_tests::private_keychain() {
        return;
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    let server = rt.block_on(baton_testserver::TestServer::start()).unwrap();
    let base = server.base_url(baton_testserver::Wire::OpenAi);
    let dir = tempfile::tempdir().unwrap();
    let h = app(dir.path(), "main");
    let plans = dir.path().join("plans.json");
    let plan = "model_id = [0, 1]\nsubtasks = [\"Gather facts.\", \"Answer.\"]\naccess_list = [[], [0]]";
    std::fs::write(&plans, json!({ "sky": plan }).to_string()).unwrap();
    let mut remote = conductor();
    remote["url"] = json!(base);
    remote["model"] = json!(format!("cond;knows={}", plans.display()));
    let workers = [worker("a", "a;reply=facts", &base), worker("b", "b;reply=blue_light_scatters", &base)];
    invoke(&h, "save_settings", json!({ "form": { "workers": workers, "conductor": remote.clone() } })).unwrap();
    let off = invoke(&h, "local_api_status", json!({})).unwrap();
    assert_eq!(
        (&off["running"], &off["form"]["enabled"], &off["form"]["port"]),
        (&json!(false), &json!(false), &json!(8765))
    );
    assert!(off["token_source"].as_str().unwrap().contains("keychain"), "{off}");
    let mut form = off["form"].clone();
    form["enabled"] = json!(true);
    form["port"] = json!(0);
    let on = invoke(&h, "save_local_api", json!({ "form": form.clone() })).unwrap();
    assert_eq!(on["running"], true, "{on}");
    assert_eq!(on["models"], json!(["baton", "baton/a", "baton/b"]));
    let url = on["url"].as_str().unwrap().to_owned();
    assert!(url.starts_with("http://127.0.0.1:") && url.ends_with("/v1"), "{url}");
    let token = invoke(&h, "local_api_token", json!({ "new": false })).unwrap().as_str().unwrap().to_owned();
    assert_eq!(token.len(), 64, "{token}");
    assert!(std::fs::read_to_string(dir.path().join("pool.toml")).unwrap().contains("app = true"));

    let client = reqwest::Client::new();
    let refused = rt.block_on(client.get(format!("{url}/models")).send()).unwrap();
    assert_eq!(refused.status(), 401);
    let asked = rt
        .block_on(
            client
                .post(format!("{url}/chat/completions"))
                .bearer_auth(&token)
                .json(&json!({ "model": "baton", "messages": [{ "role": "user", "content": "Why is the sky blue?" }] }))
                .send(),
        )
        .unwrap();
    assert_eq!(asked.status(), 200);
    let run_uid = asked.headers()["x-baton-run-id"].to_str().unwrap().to_owned();
    let body: Value = rt.block_on(asked.json()).unwrap();
    assert_eq!(body["choices"][0]["message"]["content"], "blue light scatters", "{body}");

    // The served run is in the app's history, with its plan and events, like any other. The
    // history is written off the answer's path, so the client can hold the answer a moment before
    // the run is recorded whole: the history lists it as running until then.
    let runs = recorded_runs(&h, 1);
    let run = invoke(&h, "get_run", json!({ "id": runs[0]["id"] })).unwrap();
    assert_eq!((&run["run"]["answer"], &run["steps"][0]["worker"]), (&json!("blue light scatters"), &json!("a")));
    assert_eq!(run["run"]["uid"], json!(run_uid), "{}", run["run"]);
    let events: Vec<baton_engine::RunEvent> = serde_json::from_value(run["events"].clone()).unwrap();
    baton_engine::event::check_sequence(&events).unwrap();
    let seen = invoke(&h, "local_api_status", json!({})).unwrap();
    assert_eq!((&seen["requests"], &seen["failed_requests"], &seen["stale"]), (&json!(2), &json!(1), &json!(false)));

    // A pool edited while it serves: shown, and applied by a restart.
    let mut more = workers.to_vec();
    more.push(worker("c", "c;reply=x", &base));
    invoke(&h, "save_settings", json!({ "form": { "workers": more, "conductor": remote } })).unwrap();
    assert_eq!(invoke(&h, "local_api_status", json!({})).unwrap()["stale"], true);
    let restarted = invoke(&h, "restart_local_api", json!({})).unwrap();
    assert_eq!((&restarted["stale"], &restarted["models"][3]), (&json!(false), &json!("baton/c")), "{restarted}");

    // A new token: the server restarts with it, and the old one is refused.
    let new = invoke(&h, "local_api_token", json!({ "new": true })).unwrap();
    assert_ne!(new, json!(token));
    let url = invoke(&h, "local_api_status", json!({})).unwrap()["url"].as_str().unwrap().to_owned();
    let old = rt.block_on(client.get(format!("{url}/models")).bearer_auth(&token).send()).unwrap();
    assert_eq!(old.status(), 401);
    let models = rt.block_on(client.get(format!("{url}/models")).bearer_auth(new.as_str().unwrap()).send()).unwrap();
    assert_eq!(models.status(), 200);

    // Off: the port no longer answers.
    form["enabled"] = json!(false);
    let stopped = invoke(&h, "save_local_api", json!({ "form": form.clone() })).unwrap();
    assert_eq!((&stopped["running"], &stopped["url"]), (&json!(false), &Value::Null));
    assert!(rt.block_on(client.get(format!("{url}/models")).send()).is_err(), "the port is closed");

    // A port another program holds: a clear error, kept for the screen.
    let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    form["enabled"] = json!(true);
    form["port"] = json!(held.local_addr().unwrap().port());
    let err = invoke(&h, "save_local_api", json!({ "form": form })).unwrap_err();
    assert!(err["message"].as_str().unwrap().contains("cannot listen on 127.0.0.1"), "{err}");
    let failed = invoke(&h, "local_api_status", json!({})).unwrap();
    assert_eq!(failed["running"], false);
    assert_eq!(failed["error"], err["message"], "{failed}");
}
