//! The warm helper: `baton ask` and `baton plan` with a local model run in a helper process
//! that the command line starts itself and that keeps the models loaded between questions.
//! Each test has a runtime directory of its own, so a helper of its own; a helper whose
//! directory is gone exits within a second.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use baton_tests::{Output, TEST_KEY, W, arg, write_pool};
use baton_testserver::{Options, TestServer};
use serde_json::Value;

async fn server() -> TestServer {
    TestServer::start_with(Options { key: Some(TEST_KEY.into()), ..Options::default() }).await.expect("server")
}

/// Runs `baton args` with the helper on (idle `keep_warm` seconds) and its socket under
/// `runtime`.
async fn baton(runtime: &Path, keep_warm: &str, args: &[&str], stdin: Option<&str>) -> Output {
    let bin = Path::new(env!("CARGO_BIN_EXE_baton"));
    let env = [
        ("XDG_RUNTIME_DIR", Some(arg(runtime))),
        ("BATON_KEEP_WARM", Some(keep_warm)),
        ("BATON_E2E_KEY", Some(TEST_KEY)),
    ];
    baton_tests::run_within(Duration::from_secs(240), bin, args, stdin, &env).await
}

/// The helper's pid, as the client says it started or used one.
fn helper_pid(stderr: &str) -> Option<u32> {
    let at = stderr.find("baton's helper (pid ")? + "baton's helper (pid ".len();
    stderr[at..].split(')').next()?.parse().ok()
}

fn alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| s.contains(") Z "))
}

/// A pool on `server` whose conductor is a tiny random GGUF model written into `dir`.
fn tiny_conductor_pool(dir: &Path, server: &TestServer) -> (PathBuf, PathBuf) {
    let model = dir.join("tiny-conductor.gguf");
    baton_tinymodel::write_gguf_model(&model, &baton_tinymodel::TinySpec::default()).expect("write model");
    let pool = write_pool(dir, server, "", &[W("a", "openai", "a"), W("b", "anthropic", "b")]);
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
async fn a_second_question_uses_the_model_the_first_loaded_until_its_file_changes() {
    let s = server().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let runtime = tempfile::tempdir().expect("runtime dir");
    let (pool, model) = tiny_conductor_pool(dir.path(), &s);
    let plan = |q: &'static str| ["plan", "--pool", arg(&pool), "--json", q];

    let first = baton(runtime.path(), "60", &plan("Why is the sky blue?"), None).await;
    assert_eq!(first.code, Some(0), "{}", first.stderr);
    assert!(first.stderr.contains("started baton's helper (pid "), "it says it started one: {}", first.stderr);
    assert!(first.stderr.contains("exits after 60 s without one"), "{}", first.stderr);
    let pid = helper_pid(&first.stderr).expect("a pid");
    assert!(alive(pid), "the helper outlives the command");
    let json: Value = serde_json::from_str(first.stdout.trim()).expect("the plan as JSON");
    assert!(json["model_id"].as_array().is_some_and(|ids| !ids.is_empty()), "{json}");

    let second = baton(runtime.path(), "60", &plan("Why is grass green?"), None).await;
    assert_eq!(second.code, Some(0), "{}", second.stderr);
    assert!(
        second.stderr.contains(&format!("using the models kept loaded by baton's helper (pid {pid})")),
        "{}",
        second.stderr
    );
    serde_json::from_str::<Value>(second.stdout.trim()).expect("the plan as JSON");
    // Without --json the load notices show: none, since the model is loaded.
    let third = baton(runtime.path(), "60", &["plan", "--pool", arg(&pool), "Why?"], None).await;
    assert_eq!(third.code, Some(0), "{}", third.stderr);
    assert!(!third.stderr.contains("loading the conductor"), "loaded once: {}", third.stderr);
    assert!(third.stdout.contains("model_id = ["), "{}", third.stdout);

    // A model file replaced since (pulled again, say) is loaded again.
    let later = std::time::SystemTime::now() + Duration::from_secs(5);
    std::fs::File::options().write(true).open(&model).and_then(|f| f.set_modified(later)).expect("touch");
    let fourth = baton(runtime.path(), "60", &["plan", "--pool", arg(&pool), "Why?"], None).await;
    assert_eq!(fourth.code, Some(0), "{}", fourth.stderr);
    assert!(fourth.stderr.contains("loading the conductor"), "loaded again: {}", fourth.stderr);
    assert_eq!(helper_pid(&fourth.stderr), Some(pid));

    // A helper that died leaves its socket behind: the next command starts another.
    assert!(std::process::Command::new("kill").args(["-KILL", &pid.to_string()]).status().expect("kill").success());
    let deadline = Instant::now() + Duration::from_secs(5);
    while alive(pid) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let fifth = baton(runtime.path(), "60", &plan("Why?"), None).await;
    assert_eq!(fifth.code, Some(0), "{}", fifth.stderr);
    assert!(fifth.stderr.contains("started baton's helper"), "{}", fifth.stderr);
    assert_ne!(helper_pid(&fifth.stderr), Some(pid));
    assert!(s.requests().is_empty(), "planning calls no worker");
}

#[tokio::test(flavor = "multi_thread")]
async fn through_the_helper_a_command_reads_its_input_writes_its_output_and_fails_as_it_would() {
    let s = server().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let runtime = tempfile::tempdir().expect("runtime dir");
    let (pool, _) = tiny_conductor_pool(dir.path(), &s);

    // The question from stdin, every event as JSON on stdout.
    let question = "What is the capital of the country north of Austria?";
    let out =
        baton(runtime.path(), "60", &["ask", "--json", "--no-history", "--pool", arg(&pool), "-"], Some(question))
            .await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let events: Vec<Value> = out.stdout.lines().map(|l| serde_json::from_str(l).expect("a JSON event")).collect();
    assert_eq!(events.last().and_then(|e| e["type"].as_str()), Some("run_finished"), "{}", out.stdout);
    assert!(
        s.requests().iter().any(|r| r.body.to_string().contains("north of Austria")),
        "the workers were asked the question from stdin"
    );

    // The answer on stdout, progress on stderr, the run in the history.
    let db = dir.path().join("history.sqlite");
    let out = baton(runtime.path(), "60", &["ask", "--db", arg(&db), "--pool", arg(&pool), "Say hi."], None).await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(out.stdout.contains("answers:"), "the last worker's answer: {}", out.stdout);
    assert!(out.stderr.contains("plan: ") && out.stderr.contains("recorded as run 1"), "{}", out.stderr);
    let listed = baton(runtime.path(), "60", &["history", "--db", arg(&db), "list"], None).await;
    assert!(listed.stdout.contains("Say hi."), "{}", listed.stdout);

    // A command's own error, with its exit code.
    let out =
        baton(runtime.path(), "60", &["ask", "--pool", arg(&pool), "--conductor", "/nowhere/model.gguf", "Q"], None)
            .await;
    assert_eq!(out.code, Some(2), "{}", out.stderr);
    assert!(out.stderr.contains("/nowhere/model.gguf: not found"), "{}", out.stderr);

    let out = baton(runtime.path(), "soon", &["plan", "--pool", arg(&pool), "Q"], None).await;
    assert_eq!(out.code, Some(2), "{}", out.stderr);
    assert!(out.stderr.contains("BATON_KEEP_WARM=soon") && out.stderr.contains("0 for no helper"), "{}", out.stderr);

    // Off: no helper, the model loads in the command's process.
    let out = baton(runtime.path(), "0", &["plan", "--pool", arg(&pool), "Q"], None).await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(!out.stderr.contains("helper") && out.stderr.contains("loading the conductor"), "{}", out.stderr);
}

/// A pool with a slow remote worker (model 0: it answers after 20 s) and a local one (model
/// 1), which sends `ask` to the helper; `ask` runs a written plan on it.
struct SlowPool {
    pool: PathBuf,
    db: PathBuf,
    runtime: PathBuf,
    /// Takes its time: model 0.
    slow_plan: PathBuf,
    /// Answers at once: model 1.
    fast_plan: PathBuf,
}

fn slow_pool(dir: &Path, runtime: &Path, s: &TestServer) -> SlowPool {
    let model = dir.join("tiny.gguf");
    baton_tinymodel::write_gguf_model(&model, &baton_tinymodel::TinySpec::default()).expect("write model");
    let pool = write_pool(dir, s, "", &[W("slow", "openai", "slow;latency=20000;chunks=40")]);
    let text = std::fs::read_to_string(&pool).expect("pool");
    let local = format!("\n[[worker]]\nname = \"local\"\nprovider = \"local\"\nmodel = \"{}\"\n", model.display());
    std::fs::write(&pool, format!("{text}{local}")).expect("write pool");
    let slow_plan = dir.join("slow.txt");
    std::fs::write(&slow_plan, "model_id = [0]\nsubtasks = ['take your time']\naccess_list = [[]]").expect("write");
    let fast_plan = dir.join("fast.txt");
    std::fs::write(&fast_plan, "model_id = [1]\nsubtasks = ['say hi']\naccess_list = [[]]").expect("write");
    SlowPool { pool, db: dir.join("history.sqlite"), runtime: runtime.to_owned(), slow_plan, fast_plan }
}

impl SlowPool {
    /// `baton ask --plan PLAN QUESTION`, each with the same environment, so the same helper.
    fn ask(&self, plan: &Path, question: &str) -> tokio::process::Child {
        let args = ["ask", "--pool", arg(&self.pool), "--plan", arg(plan), question];
        tokio::process::Command::new(env!("CARGO_BIN_EXE_baton"))
            .args(args)
            .env("BATON_ALLOW_KEY_ENV", baton_tests::consent(&args).unwrap_or_default())
            .env("BATON_DB", &self.db)
            .env("BATON_E2E_KEY", TEST_KEY)
            .env("BATON_KEEP_WARM", "60")
            .env("XDG_RUNTIME_DIR", &self.runtime)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn")
    }

    async fn history(&self) -> String {
        baton(&self.runtime, "0", &["history", "--db", arg(&self.db), "list"], None).await.stdout
    }
}

/// Until the slow worker has a request: a run is under way in the helper.
async fn until_called(s: &TestServer) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while s.requests().is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!s.requests().is_empty(), "the slow worker was never called");
}

fn interrupt(child: &tokio::process::Child) {
    let pid = child.id().expect("pid").to_string();
    assert!(std::process::Command::new("kill").args(["-INT", &pid]).status().expect("kill").success());
}

#[tokio::test(flavor = "multi_thread")]
async fn ctrl_c_at_the_command_stops_the_run_in_the_helper_which_records_it_and_stays() {
    let s = server().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let runtime = tempfile::tempdir().expect("runtime dir");
    let p = slow_pool(dir.path(), runtime.path(), &s);

    let child = p.ask(&p.slow_plan, "Q");
    until_called(&s).await;
    interrupt(&child);
    let started = Instant::now();
    let out =
        tokio::time::timeout(Duration::from_secs(10), child.wait_with_output()).await.expect("exits").expect("output");
    // The slow worker would answer after 20 s: well before that (a loaded 2-core machine
    // takes a few seconds to wind a run up).
    assert!(started.elapsed() < Duration::from_secs(8), "stops promptly");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("cancelled") && stderr.contains("interrupted"), "{stderr}");
    let listed = p.history().await;
    assert!(listed.contains("cancelled"), "recorded as cancelled: {listed}");

    // The terminal's Ctrl-C went to the command alone: the helper serves the next one.
    let helper = helper_pid(&stderr).expect("the helper's pid");
    assert!(alive(helper), "the helper stays after the command's Ctrl-C");
    let out = tokio::time::timeout(Duration::from_secs(60), p.ask(&p.fast_plan, "Q").wait_with_output())
        .await
        .expect("finishes")
        .expect("output");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains(&format!("(pid {helper})")) && !stderr.contains("loading"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_command_waits_for_the_one_under_way_and_ctrl_c_while_it_waits_never_starts_it() {
    use tokio::io::AsyncBufReadExt;
    let s = server().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let runtime = tempfile::tempdir().expect("runtime dir");
    let p = slow_pool(dir.path(), runtime.path(), &s);

    let first = p.ask(&p.slow_plan, "the first question");
    until_called(&s).await;
    let mut second = p.ask(&p.fast_plan, "the second question");
    // It says that it waits.
    let mut lines = tokio::io::BufReader::new(second.stderr.take().expect("stderr")).lines();
    let mut said = String::new();
    let waited = tokio::time::timeout(Duration::from_secs(30), async {
        while let Ok(Some(line)) = lines.next_line().await {
            said.push_str(&line);
            said.push('\n');
            if line.contains("waiting for the command that baton's helper is running to finish") {
                return true;
            }
        }
        false
    })
    .await;
    assert_eq!(waited, Ok(true), "{said}");
    interrupt(&second);
    let out =
        tokio::time::timeout(Duration::from_secs(10), second.wait_with_output()).await.expect("exits").expect("output");
    while let Ok(Some(line)) = lines.next_line().await {
        said.push_str(&line);
        said.push('\n');
    }
    assert_eq!(out.status.code(), Some(130), "{said}");
    assert!(said.contains("interrupted"), "{said}");

    // The first goes on, and is the only run recorded: the second never started.
    interrupt(&first);
    let out =
        tokio::time::timeout(Duration::from_secs(10), first.wait_with_output()).await.expect("exits").expect("output");
    assert_eq!(out.status.code(), Some(130), "{}", String::from_utf8_lossy(&out.stderr));
    let listed = p.history().await;
    assert!(listed.contains("the first question"), "{listed}");
    assert!(!listed.contains("the second question"), "the second command ran: {listed}");
    assert_eq!(s.requests().len(), 1, "one worker call, the first command's");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_helper_exits_once_idle_and_takes_its_socket_along() {
    let s = server().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let runtime = tempfile::tempdir().expect("runtime dir");
    let (pool, _) = tiny_conductor_pool(dir.path(), &s);
    let out = baton(runtime.path(), "1", &["plan", "--pool", arg(&pool), "--json", "Q"], None).await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let pid = helper_pid(&out.stderr).expect("a pid");
    let sockets = runtime.path().join("baton");
    let deadline = Instant::now() + Duration::from_secs(15);
    while (alive(pid) || std::fs::read_dir(&sockets).expect("dir").next().is_some()) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(!alive(pid), "the helper is still running 15 s after its 1 s idle time");
    assert!(std::fs::read_dir(&sockets).expect("dir").next().is_none(), "its socket was left behind");
}

/// The real model: a plan written cold in the helper is the plan a process of its own writes
/// (the conductor decodes greedily, from the same whole prompt), and a warm one reads its fixed
/// prompt from cache and is a plan too. A warm plan is not held to be the same bytes: a prompt
/// read partly from cache sums its attention in another order than a whole one, and a near-tie
/// between two tokens can then go the other way.
#[tokio::test(flavor = "multi_thread")]
async fn the_real_conductor_writes_the_same_plan_in_the_helper_as_in_a_process_of_its_own() {
    let Some(model) = baton_tests::real_model() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let runtime = tempfile::tempdir().expect("runtime dir");
    let mut text = format!(
        "[conductor]\nmodel = \"{}\"\ndevice = \"cpu\"\nmax_reasoning_chars = 150\nmax_subtask_chars = 150\n",
        model.display()
    );
    for (name, description) in [("coder", "writes and fixes code"), ("writer", "writes prose"), ("math", "arithmetic")]
    {
        text.push_str(&format!(
            "\n[[worker]]\nname = \"{name}\"\nprovider = \"openai-compatible\"\nmodel = \"m\"\nbase_url = \"http://127.0.0.1:9/v1\"\ndescription = \"{description}\"\n"
        ));
    }
    let pool = dir.path().join("pool.toml");
    std::fs::write(&pool, text).expect("write pool");
    let plan = |q: &'static str| ["plan", "--pool", arg(&pool), q];
    let question = "Write a Python function that reverses a string.";

    let alone = baton(runtime.path(), "0", &plan(question), None).await;
    assert_eq!(alone.code, Some(0), "{}", alone.stderr);
    let cold = baton(runtime.path(), "60", &plan(question), None).await;
    assert_eq!(cold.code, Some(0), "{}", cold.stderr);
    assert!(cold.stderr.contains("started baton's helper"), "{}", cold.stderr);
    let other = baton(runtime.path(), "60", &plan("What is 12 times 12?"), None).await;
    assert_eq!(other.code, Some(0), "{}", other.stderr);
    let warm = baton(runtime.path(), "60", &plan(question), None).await;
    assert_eq!(warm.code, Some(0), "{}", warm.stderr);
    assert!(warm.stderr.contains("using the models kept loaded"), "{}", warm.stderr);
    assert!(alone.stdout.contains("model_id = ["), "{}", alone.stdout);
    assert_eq!(cold.stdout, alone.stdout, "cold in the helper");
    assert!(warm.stdout.contains("model_id = ["), "warm in the helper: {}", warm.stdout);
    let cached = |stderr: &str| -> u64 {
        let at = stderr.find(" cached)").unwrap_or_else(|| panic!("no cache figure: {stderr}"));
        stderr[..at].rsplit('(').next().and_then(|n| n.trim().parse().ok()).expect("a number")
    };
    assert_eq!(cached(&alone.stderr), 0, "{}", alone.stderr);
    assert!(cached(&warm.stderr) > 100, "the fixed prompt comes from cache: {}", warm.stderr);
}
