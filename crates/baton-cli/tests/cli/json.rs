//! Every `--json` output against docs/json.md: each command the page documents runs here over
//! loopback servers, and what it prints must have every field the page's table lists for it,
//! with the type the table says, and nothing the table does not list. The tables are read from
//! the page itself, so a page and a program that drift apart fail here.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::OnceLock;
use std::time::Duration;

use baton_tests::{Output, TEST_KEY, W, fixture, write_pool};
use baton_testserver::Wire;
use serde_json::Value;

use super::{baton, path, server};

/// Every output docs/json.md documents; each is checked by a test below.
const OUTPUTS: &[&str] = &[
    "baton ask --json",
    "baton plan --json",
    "baton plan parse",
    "baton pool check --json",
    "baton keys list --json",
    "baton models pull --json",
    "baton models list --json",
    "baton models catalog --json",
    "baton history list --json",
    "baton history list --conversations --json",
    "baton history search --json",
    "baton history show --json",
    "baton history export --json",
    "baton history export --conversation --json",
    "baton history workers --json",
    "baton history delete --json",
    "baton eval run --json",
    "baton eval show --json",
    "baton eval list --json",
    "baton bench executor --json",
    "baton bench history --json",
    "baton bench serve --json",
    "baton bench flood --json",
    "baton bench conductor --json",
];

/// A row of a table: the field and its type cell.
#[derive(Debug)]
struct Field {
    name: String,
    ty: String,
}

/// The page's tables by heading: `baton ask --json` for an output, `Usage` for a shape,
/// `baton ask --json / run_started` for a table under a `####` heading of an output's.
fn doc() -> &'static BTreeMap<String, Vec<Field>> {
    static DOC: OnceLock<BTreeMap<String, Vec<Field>>> = OnceLock::new();
    DOC.get_or_init(|| {
        let page = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/json.md");
        tables(&std::fs::read_to_string(&page).unwrap_or_else(|e| panic!("{}: {e}", page.display())))
    })
}

fn tables(text: &str) -> BTreeMap<String, Vec<Field>> {
    let code = |heading: &str| {
        let h = heading.trim();
        (h.len() > 2 && h.starts_with('`') && h.ends_with('`')).then(|| h.trim_matches('`').to_owned())
    };
    let mut out: BTreeMap<String, Vec<Field>> = BTreeMap::new();
    let (mut parent, mut table) = (None::<String>, None::<String>);
    for line in text.lines() {
        if let Some(h) = line.strip_prefix("#### ") {
            table = parent.as_ref().zip(code(h)).map(|(p, h)| format!("{p} / {h}"));
        } else if let Some(h) = line.strip_prefix("### ") {
            parent = code(h);
            table = parent.clone();
        } else if line.starts_with('#') {
            (parent, table) = (None, None);
        } else if let Some(t) = &table
            && line.starts_with("| `")
        {
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            assert!(cells.len() >= 4, "docs/json.md: a row without a type: {line}");
            out.entry(t.clone())
                .or_default()
                .push(Field { name: cells[1].trim_matches('`').into(), ty: cells[2].into() });
        }
    }
    out
}

/// What is wrong with `value` as the type cell `ty` says, at `at`.
fn check_type(ty: &str, value: &Value, at: &str) -> Vec<String> {
    let bare = ty.strip_prefix("optional ").unwrap_or(ty);
    bare.split(" or ")
        .find_map(|alternative| kind(alternative.trim(), value, at))
        .unwrap_or_else(|| vec![format!("{at}: {} is not {ty}", short(value))])
}

/// `None` when `value` is not of this kind at all; else what is wrong inside it.
fn kind(ty: &str, value: &Value, at: &str) -> Option<Vec<String>> {
    let is = |yes: bool| yes.then(Vec::new);
    match ty {
        "integer" => is(value.is_i64() || value.is_u64()),
        "number" => is(value.is_number()),
        "string" => is(value.is_string()),
        "boolean" => is(value.is_boolean()),
        "null" => is(value.is_null()),
        "object" => is(value.is_object()),
        "array" => is(value.is_array()),
        _ => match ty.strip_prefix("array of ") {
            Some(item) => Some(
                value
                    .as_array()?
                    .iter()
                    .enumerate()
                    .flat_map(|(i, v)| check_type(item, v, &format!("{at}[{i}]")))
                    .collect(),
            ),
            None if doc().contains_key(ty) => value.is_object().then(|| check_object(&[ty], value, at)),
            None => Some(vec![format!("{at}: docs/json.md names no type or table {ty:?}")]),
        },
    }
}

/// What is wrong with the object `value` as the tables `names` together describe it.
fn check_object(names: &[&str], value: &Value, at: &str) -> Vec<String> {
    let mut errors = Vec::new();
    let mut fields = Vec::new();
    for name in names {
        match doc().get(*name) {
            Some(rows) => fields.extend(rows),
            None => errors.push(format!("{at}: docs/json.md has no table `{name}`")),
        }
    }
    let Some(object) = value.as_object() else {
        return vec![format!("{at}: {} is not an object", short(value))];
    };
    for f in &fields {
        match object.get(&f.name) {
            None if f.ty.starts_with("optional ") => {}
            None => errors.push(format!("{at}.{}: documented as {} but not printed", f.name, f.ty)),
            Some(v) => errors.extend(check_type(&f.ty, v, &format!("{at}.{}", f.name))),
        }
    }
    for key in object.keys() {
        if !fields.iter().any(|f| &f.name == key) {
            errors.push(format!("{at}.{key}: printed but not in docs/json.md's table"));
        }
    }
    errors
}

fn short(value: &Value) -> String {
    let text = value.to_string();
    match text.char_indices().nth(200) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text,
    }
}

/// Checks one printed object against `output`'s table (and `more` tables, for an event).
fn documented(output: &str, more: Option<&str>, value: &Value) {
    assert_eq!(value["version"], 1, "{output}: every object printed is version 1: {}", short(value));
    let names: Vec<&str> = std::iter::once(output).chain(more).collect();
    let errors = check_object(&names, value, output);
    assert!(errors.is_empty(), "{output} differs from docs/json.md:\n  {}", errors.join("\n  "));
}

/// Each line of a JSON-lines output, checked; at least one.
fn documented_lines(output: &str, out: &Output) -> Vec<Value> {
    assert_eq!(out.code, Some(0), "{output}: {}", out.stderr);
    let lines: Vec<Value> =
        out.stdout.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{output}: {e}: {l}"))).collect();
    assert!(!lines.is_empty(), "{output} printed nothing: {}", out.stderr);
    for line in &lines {
        documented(output, None, line);
    }
    lines
}

/// A whole-stdout object (one line, or indented), checked.
fn documented_object(output: &str, out: &Output) -> Value {
    assert_eq!(out.code, Some(0), "{output}: {}", out.stderr);
    let value: Value = serde_json::from_str(out.stdout.trim()).unwrap_or_else(|e| panic!("{output}: {e}"));
    documented(output, None, &value);
    value
}

/// Checks `ask --json` events: the common table and the event's own.
fn documented_events(stdout: &str, seen: &mut BTreeSet<String>) {
    for line in stdout.lines() {
        let event: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        let kind = event["type"].as_str().unwrap_or_else(|| panic!("an event without a type: {line}")).to_owned();
        documented("baton ask --json", Some(format!("baton ask --json / {kind}").as_str()), &event);
        seen.insert(kind);
    }
}

#[test]
fn the_page_documents_exactly_the_outputs_checked_here() {
    let page: BTreeSet<&str> =
        doc().keys().map(String::as_str).filter(|k| k.starts_with("baton ") && !k.contains(" / ")).collect();
    assert_eq!(page, OUTPUTS.iter().copied().collect::<BTreeSet<_>>());
    // The checker itself: a missing field, an extra one and a wrong type are each caught.
    let errors = check_object(&["StepRef"], &serde_json::json!({"round": "0", "extra": 1}), "x");
    assert_eq!(errors.len(), 3, "{errors:?}");
}

/// Runs that between them print every event but `step_reused` (which only a re-run, in the app
/// or the Local API, prints), recorded in one history; then every `history` output over it.
#[tokio::test(flavor = "multi_thread")]
async fn ask_and_history_print_what_the_page_documents() {
    let s = server().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("history.sqlite");
    let mut seen = BTreeSet::new();

    // A remote conductor that hands the last step back to itself (a second round), a worker
    // retried once: plan_started, plan_delta, plan_ready, step_retrying, run_finished …
    let conductor = format!(
        "[conductor]\nurl = \"{}\"\nmodel = \"big-conductor\"\napi_key_env = \"BATON_E2E_KEY\"\nfallback_worker = \"claude\"\n\n[recursion]\nenabled = true\nmax_depth = 1\n",
        s.base_url(Wire::OpenAi)
    );
    let main = dir.path().join("main");
    std::fs::create_dir(&main).expect("dir");
    let pool =
        write_pool(&main, &s, &conductor, &[W("gpt", "openai", "gpt;fail=429x1"), W("claude", "anthropic", "c")]);
    let first = "```python\nmodel_id = [0, 1, 2]\nsubtasks = [\"Draft.\", \"Review.\", \"Improve the draft.\"]\naccess_list = [[], \"all\", \"all\"]\n```";
    let second =
        "```python\nmodel_id = [1, 0]\nsubtasks = [\"Polish it.\", \"Check.\"]\naccess_list = [\"all\", \"all\"]\n```";
    s.queue_replies("big-conductor", [first, second]);
    let out = baton(&["ask", "--json", "--pool", path(&pool), "--db", path(&db), "What is 2+2?"], None, TEST_KEY).await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    documented_events(&out.stdout, &mut seen);

    // A plan that copies the prompt's example: plan_rejected, and a fallback plan.
    let copied = "```python\nmodel_id = [0]\nsubtasks = [\"Factor 360; count divisors from the exponents.\"]\naccess_list = [[]]\n```";
    s.queue_replies("big-conductor", [copied, copied]);
    let question = "How many positive divisors does 196 have?";
    let out = baton(&["ask", "--json", "--pool", path(&pool), "--db", path(&db), question], None, TEST_KEY).await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    documented_events(&out.stdout, &mut seen);

    // A worker that always refuses: step_failed, run_failed.
    let failing = dir.path().join("failing");
    std::fs::create_dir(&failing).expect("dir");
    let pool = write_pool(&failing, &s, "", &[W("bad", "openai", "bad;fail=400x*")]);
    let plan = dir.path().join("plan.txt");
    std::fs::write(&plan, "model_id = [0]\nsubtasks = [\"Explain.\"]\naccess_list = [[]]").expect("write");
    let args = ["ask", "--json", "--pool", path(&pool), "--plan", path(&plan), "--db", path(&db), "Why?"];
    let out = baton(&args, None, TEST_KEY).await;
    assert_eq!(out.code, Some(1), "{}", out.stderr);
    documented_events(&out.stdout, &mut seen);

    // Stopped while a step answers: run_cancelled.
    let slow = dir.path().join("slow");
    std::fs::create_dir(&slow).expect("dir");
    let pool = write_pool(&slow, &s, "", &[W("slow", "openai", "slow;latency=8000")]);
    let args = ["ask", "--json", "--pool", path(&pool), "--plan", path(&plan), "--db", path(&db), "Why blue?"];
    let stdout = interrupted_after_a_delta(&args).await;
    documented_events(&stdout, &mut seen);

    // The one event `ask` cannot print, as the engine writes it and `ask` prints events.
    let reused = baton_engine::RunEvent::StepReused {
        round: 0,
        step: 1,
        worker: 0,
        output: "kept".into(),
        from_run: "run-1".into(),
    };
    let mut line = serde_json::to_value(&reused).expect("json");
    line.as_object_mut().expect("an object").insert("version".into(), 1.into());
    documented_events(&line.to_string(), &mut seen);

    let events: BTreeSet<String> =
        doc().keys().filter_map(|k| k.strip_prefix("baton ask --json / ")).map(str::to_owned).collect();
    assert_eq!(seen, events, "every documented event is checked, and every event printed is documented");

    history_outputs(&db).await;
}

/// Starts `baton ARGS`, reads its events until the first `step_delta`, interrupts it as Ctrl-C
/// does, and returns everything it printed.
async fn interrupted_after_a_delta(args: &[&str]) -> String {
    use tokio::io::AsyncBufReadExt;
    let mut child =
        baton_tests::spawn_with_stdout(Path::new(env!("CARGO_BIN_EXE_baton")), args, std::process::Stdio::piped());
    let mut lines = tokio::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut stdout = String::new();
    loop {
        let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await
            .expect("the answer streams")
            .expect("read")
            .expect("a line before the end");
        stdout.push_str(&line);
        stdout.push('\n');
        if line.contains(r#""type":"step_delta""#) {
            break;
        }
    }
    let pid = child.id().expect("pid").to_string();
    assert!(std::process::Command::new("kill").args(["-INT", &pid]).status().expect("kill").success());
    while let Some(line) = lines.next_line().await.expect("read") {
        stdout.push_str(&line);
        stdout.push('\n');
    }
    let status = tokio::time::timeout(Duration::from_secs(10), child.wait()).await.expect("exits").expect("status");
    assert_eq!(status.code(), Some(130));
    stdout
}

/// Every `history` output over `db`, which holds a finished, a fallback, a failed and a
/// cancelled run in one conversation each.
async fn history_outputs(db: &Path) {
    let db = path(db);
    let history = async |args: &[&str]| {
        let mut all = vec!["history"];
        all.extend_from_slice(args);
        all.extend_from_slice(&["--db", db]);
        baton(&all, None, "").await
    };
    let runs = documented_lines("baton history list --json", &history(&["list", "--json"]).await);
    assert_eq!(runs.len(), 4, "{runs:?}");
    let conversations = documented_lines(
        "baton history list --conversations --json",
        &history(&["list", "--conversations", "--json"]).await,
    );
    documented_lines("baton history search --json", &history(&["search", "divisors", "--json"]).await);
    for run in &runs {
        let id = run["id"].to_string();
        let shown = documented_object("baton history show --json", &history(&["show", &id, "--json"]).await);
        assert_eq!(shown["run"]["id"], run["id"]);
    }
    let id = runs[0]["id"].to_string();
    documented_object("baton history export --json", &history(&["export", &id, "--json"]).await);
    let conversation = conversations[0]["id"].to_string();
    documented_object(
        "baton history export --conversation --json",
        &history(&["export", "--conversation", &conversation, "--json"]).await,
    );
    documented_lines("baton history workers --json", &history(&["workers", "--json"]).await);
    documented_lines("baton history delete --json", &history(&["delete", &id, "--json"]).await);
}

/// `plan --json` and `plan parse` print the documented object, and it reads back: into
/// `plan parse`, into `ask --plan`, and into `baton_plan::Plan`; a newer version is refused.
#[tokio::test(flavor = "multi_thread")]
async fn plan_prints_what_the_page_documents_and_reads_it_back() {
    let parsed = baton(&["plan", "parse", path(&fixture("fanout-plan.txt"))], None, "").await;
    documented_object("baton plan parse", &parsed);

    let s = server().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let conductor = format!(
        "[conductor]\nurl = \"{}\"\nmodel = \"planner\"\napi_key_env = \"BATON_E2E_KEY\"\n",
        s.base_url(Wire::OpenAi)
    );
    let pool = write_pool(dir.path(), &s, &conductor, &[W("gpt", "openai", "gpt"), W("claude", "anthropic", "c")]);
    let plan = "```python\nmodel_id = [0, 1]\nsubtasks = [\"Answer.\", \"Check.\"]\naccess_list = [[], \"all\"]\n```";
    s.queue_replies("planner", [plan]);
    let out = baton(&["plan", "--json", "--pool", path(&pool), "What is 2+2?"], None, TEST_KEY).await;
    documented_object("baton plan --json", &out);
    let printed = out.stdout.trim().to_owned();
    let read: baton_plan::Plan = serde_json::from_str(&printed).expect("Plan reads what the command printed");
    assert_eq!(read.steps.len(), 2);

    let file = dir.path().join("plan.json");
    std::fs::write(&file, &printed).expect("write");
    let again = baton(&["plan", "parse", "--pool", path(&pool), path(&file)], None, "").await;
    assert_eq!((again.code, again.stdout.trim()), (Some(0), printed.as_str()), "{}", again.stderr);
    let ran = baton(&["ask", "--pool", path(&pool), "--plan", path(&file), "--no-history", "Q"], None, TEST_KEY).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    assert_eq!(ran.stdout, "c (saw 1 earlier answers) answers: Q\n");

    std::fs::write(&file, printed.replace(r#""version":1"#, r#""version":2"#)).expect("write");
    let newer = baton(&["plan", "parse", path(&file)], None, "").await;
    assert_eq!(newer.code, Some(2), "{}", newer.stdout);
    assert!(newer.stderr.contains("the plan is JSON version 2, newer than this Baton reads"), "{}", newer.stderr);
}

#[tokio::test(flavor = "multi_thread")]
async fn pool_check_and_keys_list_print_what_the_page_documents() {
    let s = server().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let workers = [W("good", "openai", "good"), W("overloaded", "anthropic", "o;fail=529")];
    let pool = write_pool(dir.path(), &s, "", &workers);
    let out = baton(&["pool", "check", "--json", "--pool", path(&pool)], None, TEST_KEY).await;
    assert_eq!(out.code, Some(1), "one worker fails: {}", out.stderr);
    let lines: Vec<Value> = out.stdout.lines().map(|l| serde_json::from_str(l).expect("json")).collect();
    assert_eq!(lines.len(), 2, "{}", out.stdout);
    for line in &lines {
        documented("baton pool check --json", None, line);
    }
    assert!(lines[1]["error"].is_object(), "the failure's error is checked too: {}", lines[1]);

    if baton_tests::private_keychain() {
        let listed = baton(&["keys", "list", "--json", "--pool", path(&pool)], None, TEST_KEY).await;
        documented_lines("baton keys list --json", &listed);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn models_print_what_the_page_documents() {
    use baton_testserver::hub::{HubOptions, TestHub};
    let hub = TestHub::start(HubOptions::default()).await.expect("hub");
    hub.add("acme/Tiny-GGUF", "tiny.gguf", vec![7u8; 4096]);
    let dir = tempfile::tempdir().expect("tempdir");
    let endpoint = hub.endpoint();
    let env = [
        ("BATON_MODELS_DIR", Some(path(dir.path()))),
        ("HF_ENDPOINT", Some(endpoint.as_str())),
        ("HF_TOKEN", None),
        ("HUGGING_FACE_HUB_TOKEN", None),
        ("DBUS_SESSION_BUS_ADDRESS", Some("unix:path=/nonexistent")),
    ];
    let models = async |args: &[&str]| {
        let mut all = vec!["models"];
        all.extend_from_slice(args);
        baton_tests::run_with(Path::new(env!("CARGO_BIN_EXE_baton")), &all, None, &env).await
    };
    documented_lines("baton models pull --json", &models(&["pull", "acme/Tiny-GGUF:tiny.gguf", "--json"]).await);
    documented_lines("baton models list --json", &models(&["list", "--json"]).await);
    documented_lines("baton models catalog --json", &models(&["catalog", "--json"]).await);
}

/// A conductor that sends each question to worker `a`, which knows every answer, against each
/// worker alone.
#[tokio::test(flavor = "multi_thread")]
async fn eval_prints_what_the_page_documents() {
    let s = server().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let write = |name: &str, text: String| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).expect("write");
        p
    };
    let (mut suite, mut knows) = (String::new(), serde_json::Map::new());
    for i in 0..6 {
        suite.push_str(&format!(
            "{{\"id\": \"n{i}\", \"kind\": \"number\", \"category\": \"sums\", \"question\": \"<N{i}> What is {i} + 40?\", \"answer\": \"{}\"}}\n",
            40 + i
        ));
        knows.insert(format!("<N{i}>"), format!("It is {}.\n#### {}", 40 + i, 40 + i).into());
    }
    let suite = write("suite.jsonl", suite);
    let know_a = write("a.json", Value::Object(knows).to_string());
    let plan = "```python\nmodel_id = [0]\nsubtasks = [\"Answer the question.\"]\naccess_list = [[]]\n```";
    let know_plans = write("plans.json", serde_json::json!({ "<N": plan }).to_string());
    let url = s.base_url(Wire::OpenAi);
    let mut pool = format!(
        "[conductor]\nurl = \"{url}\"\nmodel = \"cond;knows={}\"\napi_key_env = \"BATON_E2E_KEY\"\n\n[retry]\ninitial_delay_ms = 10\n",
        path(&know_plans)
    );
    for (name, model) in [("a", format!("a;knows={}", path(&know_a))), ("b", "b;reply=No_idea.".to_owned())] {
        pool.push_str(&format!(
            "\n[[worker]]\nname = \"{name}\"\nprovider = \"openai-compatible\"\nmodel = \"{model}\"\nbase_url = \"{url}\"\napi_key_env = \"BATON_E2E_KEY\"\nprice_in = 1.0\nprice_out = 2.0\n"
        ));
    }
    let pool = write("pool.toml", pool);
    let db = dir.path().join("history.sqlite");
    let eval = async |args: &[&str]| {
        let mut all = vec!["eval"];
        all.extend_from_slice(args);
        all.extend_from_slice(&["--db", path(&db)]);
        baton_tests::run_suite(Path::new(env!("CARGO_BIN_EXE_baton")), &all).await
    };
    let args =
        ["run", path(&suite), "--pool", path(&pool), "--strategies", "conductor,all-singles", "--id", "j", "--json"];
    let out = eval(&args).await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let last = out.stdout.lines().last().expect("the report");
    let report: Value = serde_json::from_str(last).expect("json");
    documented("baton eval run --json", None, &report);
    assert!(report["comparisons"].as_array().is_some_and(|c| !c.is_empty()), "comparisons are checked: {report}");
    assert!(report["strategies"][0]["figures"]["calls"].as_u64() > Some(0), "calls are under figures: {report}");
    documented_object("baton eval show --json", &eval(&["show", "j", "--json"]).await);
    documented_lines("baton eval list --json", &eval(&["list", "--json"]).await);
}

#[tokio::test(flavor = "multi_thread")]
async fn bench_prints_what_the_page_documents() {
    let dir = tempfile::tempdir().expect("tempdir");
    let bench = async |args: &[&str]| {
        let mut all = vec!["bench"];
        all.extend_from_slice(args);
        baton_tests::run_suite(Path::new(env!("CARGO_BIN_EXE_baton")), &all).await
    };
    let executor = bench(&["executor", "--latency-ms", "1", "--runs", "2", "--json"]).await;
    assert_eq!(documented_lines("baton bench executor --json", &executor).len(), 4);
    let db = dir.path().join("bench.sqlite");
    let args = ["history", "--db", path(&db), "--runs", "20", "--steps", "1", "--repeat", "1", "--json"];
    documented_object("baton bench history --json", &bench(&args).await);
    let args = ["serve", "--requests", "2", "--bursts", "1", "--latency-ms", "1", "--no-history", "--json"];
    documented_object("baton bench serve --json", &bench(&args).await);
    let flood = documented_object("baton bench flood --json", &bench(&["flood", "--json"]).await);
    let phases = flood["phases"].as_array().expect("phases");
    assert_eq!(phases.len(), 4, "{flood}");
    // Each bound held: the endless plan was cut off, and the body flood was partly refused.
    assert!(phases[3]["outcome"].as_str().is_some_and(|o| o.starts_with("refused")), "{flood}");
    assert!(phases[1]["outcome"].as_str().is_some_and(|o| !o.ends_with(" 0 were refused at once")), "{flood}");
}

/// `bench conductor` measures a real model writing whole plans, which takes minutes on a CPU
/// (even the tiny random model writes thousands of tokens a plan), so its table is checked
/// against the keys `bench/conductor.rs` prints rather than against a run.
#[test]
fn bench_conductor_prints_the_documented_keys() {
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/bench/conductor.rs");
    let source = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    let start = "crate::json::line(&serde_json::json!({";
    let block = source.split_once(start).map(|(_, rest)| rest).expect("bench conductor prints through json::line");
    let block = block.split_once("}))").expect("the end of its object").0;
    // Every string literal followed by a colon is a key: the values are expressions.
    let parts: Vec<&str> = block.split('"').collect();
    let printed: BTreeSet<&str> = (1..parts.len())
        .step_by(2)
        .filter(|&i| parts.get(i + 1).is_some_and(|next| next.trim_start().starts_with(':')))
        .map(|i| parts[i])
        .collect();
    let table = doc().get("baton bench conductor --json").expect("its table");
    let documented: BTreeSet<&str> = table.iter().map(|f| f.name.as_str()).filter(|n| *n != "version").collect();
    assert_eq!(printed, documented, "bench/conductor.rs and docs/json.md");
}
