//! `baton pool learn` against loopback workers scripted so the truth is known, with a scripted
//! conductor that knows nothing of the questions: it sends every question to worker 0, as an
//! unlearned conductor that knows its workers only by name does. What the pool learned must
//! change what the user gets: the right worker for each kind of question, and the cheapest one
//! where two are as good. Learned items are never scored.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use baton_tests::{Output, TEST_KEY, arg as path};
use baton_testserver::{Options, TestServer, Wire};
use serde_json::{Value, json};

async fn baton(args: &[&str]) -> Output {
    baton_tests::run_suite(Path::new(env!("CARGO_BIN_EXE_baton")), args).await
}

/// An arithmetic item (answered by whoever knows its needle) and a multiple-choice one. Their
/// words say what kind they are, as real questions' do: a new question's kind is told by the
/// learned questions that share its words.
fn number(id: &str) -> (Value, String, String) {
    let i: u32 = id.bytes().map(u32::from).sum::<u32>() % 50;
    let needle = format!("<{id}>");
    let item = json!({"id": id, "kind": "number", "category": "arithmetic",
        "question": format!("{needle} Compute the sum of {i} and 40."), "answer": (i + 40).to_string()});
    (item, needle, format!("{i} plus 40 is {}.\n#### {}", i + 40, i + 40))
}

fn choice(id: &str) -> (Value, String, String) {
    let letter = ["A", "B", "C", "D"][id.len() % 4];
    let needle = format!("<{id}>");
    let item = json!({"id": id, "kind": "choice", "category": "trivia",
        "question": format!("{needle} Trivia about capital cities: which one?\n\nA. w\nB. x\nC. y\nD. z"), "answer": letter});
    (item, needle, format!("It is the one.\nAnswer: {letter}"))
}

struct Setup {
    dir: tempfile::TempDir,
    db: PathBuf,
}

impl Setup {
    fn new() -> Setup {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = dir.path().join("history.sqlite");
        Setup { dir, db }
    }

    fn write(&self, name: &str, text: &str) -> PathBuf {
        let p = self.dir.path().join(name);
        std::fs::write(&p, text).expect("write");
        p
    }

    fn suite(&self, name: &str, items: &[&(Value, String, String)]) -> PathBuf {
        let text: String = items.iter().map(|(item, _, _)| format!("{item}\n")).collect();
        self.write(name, &text)
    }

    /// A worker that knows the answers of `items` and nothing else.
    fn knows(&self, name: &str, items: &[&(Value, String, String)]) -> PathBuf {
        let map: serde_json::Map<String, Value> =
            items.iter().map(|(_, needle, reply)| (needle.clone(), Value::from(reply.clone()))).collect();
        self.write(&format!("{name}.json"), &Value::Object(map).to_string())
    }

    /// A pool on `server` of `workers` (name, knowledge file, $ per 1M input and output), all
    /// described alike, and a conductor whose every plan is worker 0 alone.
    fn pool(&self, server: &TestServer, workers: &[(&str, &Path, f64)]) -> PathBuf {
        let plan =
            "Route it.\n```python\nmodel_id = [0]\nsubtasks = [\"Answer the question.\"]\naccess_list = [[]]\n```";
        let conductor = self.write("conductor.json", &json!({ "<": plan }).to_string());
        let url = server.base_url(Wire::OpenAi);
        let mut pool = format!(
            "show_question = true\n\n[conductor]\nurl = \"{url}\"\nmodel = \"cond;knows={}\"\napi_key_env = \"BATON_E2E_KEY\"\n\n[retry]\ninitial_delay_ms = 10\nmax_delay_ms = 100\n",
            path(&conductor)
        );
        for (name, knows, price) in workers {
            pool.push_str(&format!(
                "\n[[worker]]\nname = \"{name}\"\nprovider = \"openai-compatible\"\nmodel = \"{name};knows={};reply=No_idea.\"\nbase_url = \"{url}\"\napi_key_env = \"BATON_E2E_KEY\"\nprice_in = {price}\nprice_out = {}\ndescription = \"A general assistant.\"\n",
                path(knows),
                price * 2.0
            ));
        }
        self.write("pool.toml", &pool)
    }

    async fn eval(&self, suite: &Path, pool: &Path, id: &str, strategies: &str) -> HashMap<String, Value> {
        let out = baton(&[
            "eval",
            "run",
            path(suite),
            "--pool",
            path(pool),
            "--db",
            path(&self.db),
            "--strategies",
            strategies,
            "--id",
            id,
            "--json",
        ])
        .await;
        assert_eq!(out.code, Some(0), "{}", out.stderr);
        let report: Value = serde_json::from_str(out.stdout.lines().last().expect("a JSON line")).expect("json");
        let mut by: HashMap<String, Value> = report["strategies"]
            .as_array()
            .expect("strategies")
            .iter()
            .map(|s| (s["strategy"].as_str().expect("name").to_owned(), s.clone()))
            .collect();
        by.insert("comparisons".into(), report["comparisons"].clone());
        by
    }

    async fn learn(&self, suite: &Path, pool: &Path) -> Output {
        baton(&["pool", "learn", path(suite), "--pool", path(pool), "--db", path(&self.db)]).await
    }

    /// A pool of `workers` (name, knowledge file), described alike, whose scripted conductor
    /// (`plan=each` or `plan=copy`) has `extra` lines in its table.
    fn conducted(
        &self,
        server: &TestServer,
        file: &str,
        plan: &str,
        extra: &str,
        workers: &[(&str, &Path)],
    ) -> PathBuf {
        let url = server.base_url(Wire::OpenAi);
        let mut pool = format!(
            "show_question = true\n\n[conductor]\nurl = \"{url}\"\nmodel = \"cond;plan={plan}\"\napi_key_env = \"BATON_E2E_KEY\"\n{extra}\n"
        );
        for (name, knows) in workers {
            pool.push_str(&format!(
                "\n[[worker]]\nname = \"{name}\"\nprovider = \"openai-compatible\"\nmodel = \"{name};knows={};reply=No_idea.\"\nbase_url = \"{url}\"\napi_key_env = \"BATON_E2E_KEY\"\ndescription = \"A general assistant.\"\n",
                path(knows)
            ));
        }
        self.write(file, &pool)
    }
}

async fn server() -> TestServer {
    TestServer::start_with(Options { key: Some(TEST_KEY.into()), ..Options::default() }).await.expect("server")
}

fn accuracy(by: &HashMap<String, Value>, strategy: &str) -> f64 {
    by[strategy]["accuracy"].as_f64().expect("accuracy")
}

/// Two workers, each right on one kind of question, described alike. Unlearned, the conductor
/// sends everything to the first: half right. Learned on 16 items, on 40 others each kind
/// goes to its worker, with no plan written: every item right, significantly better than
/// either worker alone, and one call per item.
#[tokio::test(flavor = "multi_thread")]
async fn a_complementary_pool_learns_which_worker_is_right_on_which_kind() {
    let s = server().await;
    let setup = Setup::new();
    let learn_n: Vec<_> = (0..8).map(|i| number(&format!("ln{i}"))).collect();
    let learn_c: Vec<_> = (0..8).map(|i| choice(&format!("lc{i}"))).collect();
    let test_n: Vec<_> = (0..20).map(|i| number(&format!("tn{i}"))).collect();
    let test_c: Vec<_> = (0..20).map(|i| choice(&format!("tc{i}"))).collect();
    let numbers: Vec<_> = learn_n.iter().chain(&test_n).collect();
    let choices: Vec<_> = learn_c.iter().chain(&test_c).collect();
    let a = setup.knows("a", &numbers);
    let b = setup.knows("b", &choices);
    let pool = setup.pool(&s, &[("a", &a, 1.0), ("b", &b, 1.0)]);
    let learn = setup.suite("learn.jsonl", &learn_n.iter().chain(&learn_c).collect::<Vec<_>>());
    let held_out = setup.suite("held-out.jsonl", &test_n.iter().chain(&test_c).collect::<Vec<_>>());
    let strategies = "conductor,single:a,single:b";

    let before = setup.eval(&held_out, &pool, "before", strategies).await;
    assert_eq!(accuracy(&before, "conductor"), 0.5, "unlearned, every question goes to a");

    let out = setup.learn(&learn, &pool).await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(out.stdout.contains("arithmetic") && out.stdout.contains("  8 of 8"), "{}", out.stdout);
    assert!(out.stdout.contains("alone, without a plan"), "{}", out.stdout);

    let plans_before = s.requests().iter().filter(|r| r.model.starts_with("cond")).count();
    let after = setup.eval(&held_out, &pool, "after", strategies).await;
    assert_eq!(accuracy(&after, "conductor"), 1.0);
    assert_eq!(accuracy(&after, "single:a"), 0.5);
    assert_eq!(accuracy(&after, "single:b"), 0.5);
    let plans_after = s.requests().iter().filter(|r| r.model.starts_with("cond")).count();
    assert_eq!(plans_after, plans_before, "a clear margin writes no plan");
    assert_eq!(after["conductor"]["figures"]["calls"], 40, "one call per item");
    let against_best = &after["comparisons"][0];
    assert_eq!(against_best["a"], "conductor");
    assert_eq!((against_best["only_a"].as_u64(), against_best["only_b"].as_u64()), (Some(20), Some(0)));
    assert!(against_best["mcnemar_p"].as_f64().expect("p") < 0.05, "{against_best}");

    // What was learned is in `pool show`, with n.
    let show = baton(&["pool", "show", "--pool", path(&pool), "--db", path(&setup.db)]).await;
    assert_eq!(show.code, Some(0), "{}", show.stderr);
    assert!(show.stdout.contains("a: learned in learn-learn-"), "{}", show.stdout);
    assert!(show.stdout.contains("trivia") && show.stdout.contains("  0 of 8"), "{}", show.stdout);

    // The same command again goes on from where the last ended: nothing is left, nothing is asked.
    let calls = s.requests().len();
    let again = setup.learn(&learn, &pool).await;
    assert_eq!(again.code, Some(0), "{}", again.stderr);
    assert_eq!(s.requests().len(), calls, "a finished learning run is not run twice");

    // The pool is never scored on what it was taught with.
    let leak = baton(&[
        "eval",
        "run",
        path(&learn),
        "--pool",
        path(&pool),
        "--db",
        path(&setup.db),
        "--strategies",
        strategies,
    ])
    .await;
    assert_eq!(leak.code, Some(2), "{}", leak.stderr);
    assert!(leak.stderr.contains("every item of learn is a question this pool learned from"), "{}", leak.stderr);

    // A worker whose model changes has a stale profile, shown and not used.
    let changed = std::fs::read_to_string(&pool)
        .expect("pool")
        .replace("name = \"b\"\nprovider", "name = \"b\"\ntemperature = 1\nprovider");
    let changed_pool = setup.write("changed.toml", &changed);
    let show = baton(&["pool", "show", "--pool", path(&changed_pool), "--db", path(&setup.db)]).await;
    assert!(show.stdout.contains("b: STALE, not used"), "{}", show.stdout);
    let stale = setup.eval(&held_out, &changed_pool, "stale", "conductor").await;
    assert_eq!(accuracy(&stale, "conductor"), 0.5, "b's stale profile no longer routes the choices");
    // The conductor, planning now, is told what was measured of a, and nothing of b's stale profile.
    let told = s.requests().iter().rev().find(|r| r.model.starts_with("cond")).expect("a plan").body.to_string();
    let a_learned = "When this pool learned, it was right on 8 of 8 arithmetic questions and 0 of 8 trivia questions.";
    assert_eq!(told.matches(a_learned).count(), 1, "{told}");
    assert_eq!(told.matches("When this pool learned").count(), 1, "{told}");

    // Routing as a mode: every question to its kind's worker, one call, no conductor at all.
    let text = std::fs::read_to_string(&pool).expect("pool");
    let workers = &text[text.find("\n[[worker]]").expect("workers")..];
    let routed =
        setup.write("routed.toml", &format!("show_question = true\n\n[conductor]\nroute = \"always\"\n{workers}"));
    let (item, _, _) = &test_c[3];
    let question = item["question"].as_str().expect("question");
    let calls = s.requests().len();
    let out = baton(&["ask", question, "--pool", path(&routed), "--db", path(&setup.db)]).await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(out.stdout.contains(&format!("Answer: {}", item["answer"].as_str().expect("answer"))), "{}", out.stdout);
    assert!(out.stderr.contains("routed by what the pool learned"), "{}", out.stderr);
    let asked: Vec<String> = s.requests()[calls..].iter().map(|r| r.model.clone()).collect();
    assert_eq!(asked.len(), 1, "one call: {asked:?}");
    assert!(asked[0].starts_with("b;"), "the choice went to b: {asked:?}");

    // A draft for review is what a run would be given: b alone, and no conductor asked.
    let calls = s.requests().len();
    let draft = baton(&["plan", question, "--pool", path(&routed), "--db", path(&setup.db)]).await;
    assert_eq!(draft.code, Some(0), "{}", draft.stderr);
    assert!(draft.stdout.starts_with("No plan: routed by what the pool learned"), "{}", draft.stdout);
    let lists: Value = serde_json::from_str(draft.stdout.lines().last().expect("the plan")).expect("json");
    assert_eq!(lists["model_id"], json!([1]), "{lists}");
    assert!(draft.stderr.contains("none written"), "{}", draft.stderr);
    assert_eq!(s.requests().len(), calls, "nothing was asked");

    // The same routing behind `baton serve`: `baton` is offered with no conductor, and answers.
    let args = ["--port", "0", "--no-token", "--pool", path(&routed), "--db", path(&setup.db)];
    let bin = Path::new(env!("CARGO_BIN_EXE_baton"));
    let served = baton_tests::serve(bin, &args, &[("BATON_E2E_KEY", TEST_KEY)], Duration::from_secs(30)).await;
    let client = reqwest::Client::new();
    let models: Value = client.get(format!("{}/models", served.url)).send().await.unwrap().json().await.unwrap();
    let ids: Vec<&str> = models["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["baton", "baton/a", "baton/b"]);
    let calls = s.requests().len();
    let body: Value = client
        .post(format!("{}/chat/completions", served.url))
        .json(&json!({ "model": "baton", "messages": [{ "role": "user", "content": question }] }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let answer = body["choices"][0]["message"]["content"].as_str().unwrap_or_default();
    assert!(answer.contains(&format!("Answer: {}", item["answer"].as_str().expect("answer"))), "{body}");
    let asked: Vec<String> = s.requests()[calls..].iter().map(|r| r.model.clone()).collect();
    assert!(asked.len() == 1 && asked[0].starts_with("b;"), "one call, to b: {asked:?}");
    assert!(served.interrupt().await.success());
}

/// A multiple-choice item whose subject is its own, as MMLU's 57 subjects are to a learning run
/// of a few items each: no word of it is in any other item.
fn subject_choice(id: &str) -> (Value, String, String) {
    let (item, needle, reply) = choice(id);
    let question = format!("{needle} Quux{id} zorp{id} frob{id}?\n\nA. w\nB. x\nC. y\nD. z");
    let item = json!({"id": id, "kind": "choice", "category": format!("subject {id}"),
        "question": question, "answer": item["answer"]});
    (item, needle, reply)
}

/// Multiple-choice questions of many subjects, one item each: no subject has the runs to choose
/// a worker by, and a new subject is like nothing learned. Their kind still tells: learned, a
/// new subject's multiple-choice question goes to the worker right on multiple choice, with no
/// plan written.
#[tokio::test(flavor = "multi_thread")]
async fn questions_of_categories_too_thin_to_choose_by_go_by_their_kind() {
    let s = server().await;
    let setup = Setup::new();
    let learn_n: Vec<_> = (0..8).map(|i| number(&format!("ln{i}"))).collect();
    let learn_c: Vec<_> = (0..8).map(|i| subject_choice(&format!("lc{i}"))).collect();
    let test_n: Vec<_> = (0..10).map(|i| number(&format!("tn{i}"))).collect();
    let test_c: Vec<_> = (0..10).map(|i| subject_choice(&format!("tc{i}"))).collect();
    let a = setup.knows("a", &learn_n.iter().chain(&test_n).collect::<Vec<_>>());
    let b = setup.knows("b", &learn_c.iter().chain(&test_c).collect::<Vec<_>>());
    let pool = setup.pool(&s, &[("a", &a, 1.0), ("b", &b, 1.0)]);
    let learn = setup.suite("learn.jsonl", &learn_n.iter().chain(&learn_c).collect::<Vec<_>>());
    let held_out = setup.suite("held-out.jsonl", &test_n.iter().chain(&test_c).collect::<Vec<_>>());

    let out = setup.learn(&learn, &pool).await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let show = baton(&["pool", "show", "--pool", path(&pool), "--db", path(&setup.db)]).await;
    assert_eq!(show.code, Some(0), "{}", show.stderr);
    assert!(show.stdout.contains("subject lc3") && show.stdout.contains("  1 of 1"), "{}", show.stdout);
    assert!(show.stdout.contains("any multiple-choice    8 of 8"), "{}", show.stdout);
    assert!(show.stdout.contains("other multiple-choice b, alone, without a plan"), "{}", show.stdout);

    let plans_before = s.requests().iter().filter(|r| r.model.starts_with("cond")).count();
    let after = setup.eval(&held_out, &pool, "after", "conductor,single:a,single:b").await;
    assert_eq!(accuracy(&after, "conductor"), 1.0, "the numbers by their category, the choices by their kind");
    assert_eq!(accuracy(&after, "single:a"), 0.5);
    let plans_after = s.requests().iter().filter(|r| r.model.starts_with("cond")).count();
    assert_eq!(plans_after, plans_before, "both kinds are clear: no plan is written");
    assert_eq!(after["conductor"]["figures"]["calls"], 20, "one call per item");
}

/// A leader not clearly better (6 of 8 against 2 of 8), and a conductor whose plans, sampled
/// and scored while the pool learned, were right no more often than the leader alone: a plan is
/// not known to help, so each question goes to the leader alone, with no plan written. Learned
/// without plans, the same pool still plans every question.
#[tokio::test(flavor = "multi_thread")]
async fn a_plan_is_written_only_where_the_measured_plans_did_better_than_the_worker_alone() {
    let s = server().await;
    let setup = Setup::new();
    let learn_n: Vec<_> = (0..8).map(|i| number(&format!("ln{i}"))).collect();
    let test_n: Vec<_> = (0..12).map(|i| number(&format!("tn{i}"))).collect();
    let all: Vec<_> = learn_n.iter().chain(&test_n).collect();
    // a knows three items in four, b the fourth.
    let a = setup.knows("a", &all.iter().enumerate().filter(|(i, _)| i % 4 != 3).map(|(_, x)| *x).collect::<Vec<_>>());
    let b = setup.knows("b", &all.iter().enumerate().filter(|(i, _)| i % 4 == 3).map(|(_, x)| *x).collect::<Vec<_>>());
    let pool = setup.pool(&s, &[("a", &a, 1.0), ("b", &b, 1.0)]);
    let learn = setup.suite("learn.jsonl", &learn_n.iter().collect::<Vec<_>>());
    let held_out = setup.suite("held-out.jsonl", &test_n.iter().collect::<Vec<_>>());
    let plans = |s: &TestServer| s.requests().iter().filter(|r| r.model.starts_with("cond")).count();

    // Learned without plans: nothing says a plan does not help, so the conductor plans.
    let other = Setup::new();
    let out =
        baton(&["pool", "learn", path(&learn), "--pool", path(&pool), "--db", path(&other.db), "--plans", "0"]).await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(out.stdout.contains("a, as the plan's lead (the conductor plans)"), "{}", out.stdout);
    let before = plans(&s);
    let planned = other.eval(&held_out, &pool, "planned", "conductor").await;
    assert_eq!(plans(&s) - before, 12, "a plan for each item");
    assert_eq!(planned["conductor"]["figures"]["calls"], 24, "the plan and its step");

    let out = setup.learn(&learn, &pool).await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(out.stdout.contains("  6 of 8") && out.stdout.contains("  2 of 8"), "{}", out.stdout);
    assert!(out.stdout.contains("the conductor's plans: learned in learn-learn-"), "{}", out.stdout);
    assert!(out.stdout.contains(" 18 of 24"), "3 sampled plans an item, each right where a is: {}", out.stdout);
    assert!(out.stdout.contains("a, alone, without a plan (plans not shown to do better)"), "{}", out.stdout);
    let before = plans(&s);
    let after = setup.eval(&held_out, &pool, "after", "conductor,single:a").await;
    assert_eq!(plans(&s), before, "no plan is written");
    assert_eq!(accuracy(&after, "conductor"), accuracy(&after, "single:a"));
    assert_eq!(after["conductor"]["figures"]["calls"], 12, "one call per item");
}

/// An expensive worker right on everything and a cheap one right on arithmetic: learned, the
/// arithmetic goes to the cheap one, as right and at a fraction of the cost.
#[tokio::test(flavor = "multi_thread")]
async fn an_economy_pool_sends_each_kind_to_the_cheapest_worker_that_is_as_good() {
    let s = server().await;
    let setup = Setup::new();
    let learn_n: Vec<_> = (0..8).map(|i| number(&format!("ln{i}"))).collect();
    let learn_c: Vec<_> = (0..8).map(|i| choice(&format!("lc{i}"))).collect();
    let test_n: Vec<_> = (0..20).map(|i| number(&format!("tn{i}"))).collect();
    let everything: Vec<_> = learn_n.iter().chain(&learn_c).chain(&test_n).collect();
    let numbers: Vec<_> = learn_n.iter().chain(&test_n).collect();
    let dear = setup.knows("dear", &everything);
    let cheap = setup.knows("cheap", &numbers);
    let pool = setup.pool(&s, &[("dear", &dear, 10.0), ("cheap", &cheap, 0.1)]);
    let learn = setup.suite("learn.jsonl", &learn_n.iter().chain(&learn_c).collect::<Vec<_>>());
    let held_out = setup.suite("sums.jsonl", &test_n.iter().collect::<Vec<_>>());

    let out = setup.learn(&learn, &pool).await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let by = setup.eval(&held_out, &pool, "economy", "conductor,single:dear").await;
    assert!(accuracy(&by, "conductor") >= accuracy(&by, "single:dear") - 2.0 / 20.0, "{by:?}");
    let cost = |s: &str| by[s]["figures"]["cost_usd"].as_f64().expect("cost");
    assert!(cost("conductor") <= cost("single:dear") / 2.0, "{} against {}", cost("conductor"), cost("single:dear"));
}

/// Learning again after one worker changed asks only that worker: the other's profile is read
/// from the run that measured it, which is still current. Asking again with nothing changed
/// resumes the finished run and asks no one.
#[tokio::test(flavor = "multi_thread")]
async fn learning_again_after_one_worker_changed_asks_only_that_worker() {
    let s = server().await;
    let setup = Setup::new();
    let items: Vec<_> = (0..4).map(|i| number(&format!("ln{i}"))).collect();
    let items: Vec<_> = items.iter().collect();
    let knows = setup.knows("k", &items);
    let learn = setup.suite("learn.jsonl", &items);
    let pool = setup.pool(&s, &[("a", &knows, 1.0), ("b", &knows, 1.0)]);
    let learn_plain = |pool: PathBuf| {
        let (learn, db) = (learn.clone(), setup.db.clone());
        async move {
            baton(&["pool", "learn", path(&learn), "--pool", path(&pool), "--db", path(&db), "--plans", "0"]).await
        }
    };
    let asked = |model: &str| s.requests().iter().filter(|r| r.model.starts_with(model)).count();
    let out = learn_plain(pool.clone()).await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert_eq!((asked("a;"), asked("b;")), (4, 4));

    let text = std::fs::read_to_string(&pool).expect("pool");
    let changed = setup.write("changed.toml", &text.replacen("name = \"b\"\n", "name = \"b\"\ntemperature = 0.5\n", 1));
    let out = learn_plain(changed.clone()).await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(out.stderr.contains("a is not asked again"), "{}", out.stderr);
    assert_eq!((asked("a;"), asked("b;")), (4, 8), "only the changed worker is asked");
    for worker in ["a: learned in learn-learn-", "b: learned in learn-learn-", "4 of 4"] {
        assert!(out.stdout.contains(worker), "both profiles are current:\n{}", out.stdout);
    }
    assert!(!out.stdout.contains("STALE"), "{}", out.stdout);

    let out = learn_plain(changed).await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert_eq!((asked("a;"), asked("b;")), (4, 8), "nothing changed, nobody is asked: {}", out.stderr);
}

/// Items pinned `test` are the held-out set: learning never asks them, and says how many it left
/// out; an evaluation of the same suite then leaves out what was learned, by item id (the same
/// question in another file, by its text), and scores the held-out items.
#[tokio::test(flavor = "multi_thread")]
async fn learning_never_sees_items_pinned_test_and_an_evaluation_leaves_out_what_was_learned() {
    let s = server().await;
    let setup = Setup::new();
    let items: Vec<(Value, String, String)> = (0..8)
        .map(|i| {
            let (mut item, needle, reply) = number(&format!("sp{i}"));
            item["split"] = json!(if i < 4 { "calibration" } else { "test" });
            (item, needle, reply)
        })
        .collect();
    let all: Vec<_> = items.iter().collect();
    let knows = setup.knows("k", &all);
    let suite = setup.suite("pinned.jsonl", &all);
    let pool = setup.pool(&s, &[("a", &knows, 1.0), ("b", &knows, 1.0)]);
    let out =
        baton(&["pool", "learn", path(&suite), "--pool", path(&pool), "--db", path(&setup.db), "--plans", "0"]).await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(out.stderr.contains("4 items of pinned are pinned to the `test` split and held out"), "{}", out.stderr);
    let asked = |needle: &str| s.requests().iter().any(|r| r.body.to_string().contains(needle));
    for i in 0..8 {
        let needle = format!("<sp{i}>");
        assert_eq!(asked(&needle), i < 4, "{needle}: learned from calibration items only");
    }

    // An evaluation scores the held-out items.
    let before = s.requests().len();
    let by = setup.eval(&suite, &pool, "after", "single:a").await;
    assert_eq!(by["single:a"]["n"], 4, "the held-out items only: {:?}", by["single:a"]);
    let evaluated: Vec<String> = s.requests()[before..].iter().map(|r| r.body.to_string()).collect();
    for i in 0..8 {
        let needle = format!("<sp{i}>");
        assert_eq!(evaluated.iter().any(|b| b.contains(&needle)), i >= 4, "{needle}");
    }

    // Every item pinned `test`: nothing is left to learn from, said before any call.
    let held: Vec<_> = items[4..].iter().collect();
    let only_test = setup.suite("only-test.jsonl", &held);
    let before = s.requests().len();
    let out = baton(&["pool", "learn", path(&only_test), "--pool", path(&pool), "--db", path(&setup.db)]).await;
    assert_eq!(out.code, Some(2), "{}", out.stderr);
    assert!(out.stderr.contains("held out from learning"), "{}", out.stderr);
    assert_eq!(s.requests().len(), before, "nothing was asked");
}

/// An evaluation leaves out the items the pool learned from by the suite and the item's id, so
/// they stay out when the history no longer has their runs' questions (deleted runs).
#[tokio::test(flavor = "multi_thread")]
async fn an_evaluation_leaves_out_learned_items_by_id_when_their_runs_are_deleted() {
    let s = server().await;
    let setup = Setup::new();
    let items: Vec<_> = (0..8).map(|i| number(&format!("id{i}"))).collect();
    let all: Vec<_> = items.iter().collect();
    let knows = setup.knows("k", &all);
    let suite = setup.suite("plain.jsonl", &all);
    let pool = setup.pool(&s, &[("a", &knows, 1.0), ("b", &knows, 1.0)]);
    let db = path(&setup.db);
    let out =
        baton(&["pool", "learn", path(&suite), "--pool", path(&pool), "--db", db, "--plans", "0", "--limit", "4"])
            .await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let needles: Vec<String> = (0..8).map(|i| format!("<id{i}>")).collect();
    let learned: Vec<&String> =
        needles.iter().filter(|n| s.requests().iter().any(|r| r.body.to_string().contains(n.as_str()))).collect();
    assert_eq!(learned.len(), 4, "{learned:?}");
    // The learning runs are gone from the history: 4 items by 2 workers, the first 8 runs.
    for run in 1..=8 {
        let out = baton(&["history", "delete", &run.to_string(), "--db", db]).await;
        assert_eq!(out.code, Some(0), "run {run}: {}", out.stderr);
    }
    let before = s.requests().len();
    let by = setup.eval(&suite, &pool, "after-deleting", "single:a").await;
    assert_eq!(by["single:a"]["n"], 4, "{:?}", by["single:a"]);
    let evaluated: Vec<String> = s.requests()[before..].iter().map(|r| r.body.to_string()).collect();
    for needle in &needles {
        let asked = evaluated.iter().any(|b| b.contains(needle.as_str()));
        assert_eq!(asked, !learned.contains(&needle), "{needle}: only what was not learned is scored");
    }
}

/// What cannot be learned is said before anything runs.
#[tokio::test(flavor = "multi_thread")]
async fn a_pool_of_one_worker_and_a_suite_without_answers_are_refused() {
    let s = server().await;
    let setup = Setup::new();
    let item = number("ln0");
    let a = setup.knows("a", &[&item]);
    let one = setup.pool(&s, &[("a", &a, 1.0)]);
    let suite = setup.suite("learn.jsonl", &[&item]);
    let out = setup.learn(&suite, &one).await;
    assert_eq!(out.code, Some(2), "{}", out.stderr);
    assert!(out.stderr.contains("needs two or more"), "{}", out.stderr);

    let two = setup.pool(&s, &[("a", &a, 1.0), ("b", &a, 1.0)]);
    let unanswered =
        setup.write("unanswered.jsonl", "{\"id\": \"q\", \"kind\": \"number\", \"question\": \"What is 2 + 2?\"}\n");
    let out = setup.learn(&unanswered, &two).await;
    assert_eq!(out.code, Some(2), "{}", out.stderr);
    assert!(out.stderr.contains("answer"), "{}", out.stderr);
    assert!(s.requests().is_empty(), "nothing was asked");
}

/// Plans from what worked: while the pool learns, the conductor samples plans for each item
/// (here one on each worker) and they are run; the right ones become its examples, with the
/// workers that did the work. A conductor that follows the example closest to the question (and
/// is pinned to `a` as its lead, so the shipped examples all name `a`) is then right on both
/// kinds; learned without plans, it is right on half. The samples are GRPO training data.
#[tokio::test(flavor = "multi_thread")]
async fn the_conductor_plans_from_the_plans_that_were_right_when_the_pool_learned() {
    let s = server().await;
    let learn_n: Vec<_> = (0..8).map(|i| number(&format!("ln{i}"))).collect();
    let learn_c: Vec<_> = (0..8).map(|i| choice(&format!("lc{i}"))).collect();
    let test_n: Vec<_> = (0..20).map(|i| number(&format!("tn{i}"))).collect();
    let test_c: Vec<_> = (0..20).map(|i| choice(&format!("tc{i}"))).collect();
    let strategies = "conductor,single:a,single:b";
    let mut accuracies = Vec::new();
    for plans in ["2", "0"] {
        let setup = Setup::new();
        let a = setup.knows("a", &learn_n.iter().chain(&test_n).collect::<Vec<_>>());
        let b = setup.knows("b", &learn_c.iter().chain(&test_c).collect::<Vec<_>>());
        let workers = [("a", a.as_path()), ("b", b.as_path())];
        let learning_pool = setup.conducted(&s, "learning.toml", "each", "", &workers);
        let pinned = "route = \"never\"\nfallback_worker = \"a\"";
        let copying_pool = setup.conducted(&s, "copying.toml", "copy", pinned, &workers);
        let learn = setup.suite("learn.jsonl", &learn_n.iter().chain(&learn_c).collect::<Vec<_>>());
        let held_out = setup.suite("held-out.jsonl", &test_n.iter().chain(&test_c).collect::<Vec<_>>());

        let out = baton(&[
            "pool",
            "learn",
            path(&learn),
            "--pool",
            path(&learning_pool),
            "--db",
            path(&setup.db),
            "--plans",
            plans,
            "--concurrency",
            "1",
        ])
        .await;
        assert_eq!(out.code, Some(0), "{}", out.stderr);
        let by = setup.eval(&held_out, &copying_pool, "held-out", strategies).await;
        accuracies.push(accuracy(&by, "conductor"));
        if plans == "0" {
            continue;
        }
        assert!(out.stderr.contains("and 2 conductor plans per item"), "{}", out.stderr);
        // The conductor was shown learned plans: for a multiple-choice question, b's.
        let (item, _, _) = &test_c[0];
        let needle = item["id"].as_str().expect("id");
        let shown = s
            .requests()
            .iter()
            .rev()
            .find(|r| r.model.starts_with("cond;plan=copy") && r.body.to_string().contains(needle))
            .expect("the conductor's request")
            .body
            .to_string();
        assert!(shown.contains("Example [learned]. Question: <lc"), "{shown}");
        assert!(shown.contains("model_id = [1]"), "{shown}");
        let against_best = &by["comparisons"][0];
        assert_eq!(against_best["a"], "conductor");
        assert!(against_best["mcnemar_p"].as_f64().expect("p") < 0.05, "{against_best}");

        // `baton plan` is shown what a run is shown: with the history, the learned plan on b;
        // with a history that learned nothing, the shipped examples on the lead worker a.
        let question = item["question"].as_str().expect("question");
        let nothing = setup.dir.path().join("nothing-learned.sqlite");
        for (db, worker) in [(setup.db.as_path(), 1), (nothing.as_path(), 0)] {
            let out = baton(&["plan", "--json", "--pool", path(&copying_pool), "--db", path(db), question]).await;
            assert_eq!(out.code, Some(0), "{}", out.stderr);
            let plan: Value = serde_json::from_str(out.stdout.trim()).expect("a plan as JSON");
            let workers = plan["model_id"].as_array().expect("model ids");
            assert!(!workers.is_empty() && workers.iter().all(|w| w == worker), "{db:?}: {plan}");
        }
        assert!(!nothing.exists(), "a plan opens no history that is not there");

        // The learning run's samples are training data, a group of two per item.
        let id = out.stderr.lines().find_map(|l| l.strip_prefix("learning ")).and_then(|l| l.split(':').next());
        let grpo = setup.dir.path().join("grpo.jsonl");
        let export = baton(&[
            "eval",
            "export-grpo",
            id.expect("the learning run's id"),
            "-o",
            path(&grpo),
            "--db",
            path(&setup.db),
        ])
        .await;
        assert_eq!(export.code, Some(0), "{}", export.stderr);
        let groups: Vec<Value> = std::fs::read_to_string(&grpo)
            .expect("grpo")
            .lines()
            .map(|l| serde_json::from_str(l).expect("json"))
            .collect();
        assert_eq!(groups.len(), 16, "one group per learned item");
        for g in &groups {
            let mut rewards: Vec<f64> =
                g["rewards"].as_array().expect("rewards").iter().filter_map(Value::as_f64).collect();
            rewards.sort_by(f64::total_cmp);
            assert_eq!(rewards, [0.5, 1.0], "one sample on the right worker, one on the wrong: {g}");
        }
    }
    assert_eq!(accuracies[0], 1.0, "with learned plans");
    assert!(accuracies[1] < 0.8, "without them, the pinned lead answers every question: {}", accuracies[1]);
}

/// A word problem only two workers together answer: `reader` restates it as arithmetic
/// (`[x * y + z]`) without computing it, `calc` computes an expression it is shown in an earlier
/// answer but cannot read a word problem. Returns the item, its needle and reader's restatement,
/// and calc's table entry (the expression and its answer).
fn word(id: &str, n: u32) -> ((Value, String, String), (String, String)) {
    let (x, y, z) = (11 + n, 13 + 2 * n, 7 + n % 5);
    let needle = format!("<{id}>");
    let question = format!(
        "{needle} A farmer plants {x} rows of apple trees with {y} trees in each row, then {z} more trees by the gate. How many apple trees does the farmer have?"
    );
    let expression = format!("[{x} * {y} + {z}]");
    let answer = x * y + z;
    let item =
        json!({"id": id, "kind": "number", "category": "word", "question": question, "answer": answer.to_string()});
    let computed = format!("{expression} = {answer}\n#### {answer}");
    ((item, needle, format!("As arithmetic, the problem is {expression}.")), (expression, computed))
}

/// Only a workflow answers here: no worker alone and no plan of the conductor's (every one
/// worker 0 alone) is right on any item. Learning searches the chains of two, in a fixed
/// order, finds "reader, then calc seeing reader's answer" on every item, measures it and makes
/// it the route for word problems: on held-out items the pool goes from 0 to every item right,
/// two calls each, with no plan written. A changed worker makes the workflow stale.
#[tokio::test(flavor = "multi_thread")]
async fn a_pool_whose_workers_answer_only_together_learns_the_workflow_that_does() {
    let s = server().await;
    let setup = Setup::new();
    let learn: Vec<_> = (0..12).map(|i| word(&format!("lw{i}"), i)).collect();
    let test: Vec<_> = (0..20).map(|i| word(&format!("tw{i}"), 20 + i)).collect();
    let all: Vec<_> = learn.iter().chain(&test).collect();
    let reader = setup.knows("reader", &all.iter().map(|(item, _)| item).collect::<Vec<_>>());
    let calc: serde_json::Map<String, Value> =
        all.iter().map(|(_, (expression, reply))| (expression.clone(), Value::from(reply.clone()))).collect();
    let calc = setup.write("calc.json", &Value::Object(calc).to_string());
    let dud = setup.write("dud.json", "{}");
    // The first worker listed is the one that is always wrong, so search has to go past it.
    let text =
        std::fs::read_to_string(setup.pool(&s, &[("dud", &dud, 1.0), ("calc", &calc, 1.0), ("reader", &reader, 1.0)]))
            .expect("pool")
            .replace(
                &format!("model = \"calc;knows={}", path(&calc)),
                &format!("model = \"calc;after={}", path(&calc)),
            );
    let pool = setup.write("pool.toml", &text);
    let learn_suite = setup.suite("learn.jsonl", &learn.iter().map(|(item, _)| item).collect::<Vec<_>>());
    let held_out = setup.suite("held-out.jsonl", &test.iter().map(|(item, _)| item).collect::<Vec<_>>());
    let strategies = "conductor,single:dud,single:calc,single:reader";

    let before = setup.eval(&held_out, &pool, "before", strategies).await;
    for strategy in strategies.split(',') {
        assert_eq!(accuracy(&before, strategy), 0.0, "{strategy}: no one answers alone");
    }

    let out = setup.learn(&learn_suite, &pool).await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(out.stderr.contains("search: 12 items that no worker alone and no plan answered"), "{}", out.stderr);
    assert!(
        out.stderr.contains("at most W·(W−1) chains plus one fan-out per item = 7 runs for W = 3"),
        "{}",
        out.stderr
    );
    assert!(
        out.stderr.contains("search found reader, then calc seeing reader's answer (right on 12"),
        "{}",
        out.stderr
    );
    let route = "word                 reader, then calc seeing reader's answer, without a plan (a clear margin over every worker alone)";
    assert!(out.stdout.contains(route), "{}", out.stdout);
    // Search tried the chains in order and stopped at the first that answered: the five before it,
    // then this one, on each of the 12 items (two calls each), and no fan-out.
    let seen = |text: &str| s.requests().iter().filter(|r| r.body.to_string().contains(text)).count();
    let searched = seen(baton_engine::workflow::CHAIN_THEN);
    assert_eq!(searched, 6 * 12, "the second step of each chain tried, each once");
    assert_eq!(seen(baton_engine::workflow::FAN_OUT_THEN), 0, "no fan-out: a chain answered every item");

    // Search candidates are training data beside the conductor's samples, under its prompt.
    let id = out.stderr.lines().find_map(|l| l.strip_prefix("learning ")).and_then(|l| l.split(':').next());
    let grpo = setup.dir.path().join("grpo.jsonl");
    let id = id.expect("the learning run's id");
    let export = baton(&["eval", "export-grpo", id, "-o", path(&grpo), "--db", path(&setup.db)]).await;
    assert_eq!(export.code, Some(0), "{}", export.stderr);
    assert!(export.stderr.contains("`chain:…` and `fan-out:…` (search candidates)"), "{}", export.stderr);
    let groups: Vec<Value> =
        std::fs::read_to_string(&grpo).expect("grpo").lines().map(|l| serde_json::from_str(l).expect("json")).collect();
    assert_eq!(groups.len(), 12, "one group per learned item");
    for group in &groups {
        let sources: Vec<&str> =
            group["sources"].as_array().expect("sources").iter().filter_map(Value::as_str).collect();
        let rewards = group["rewards"].as_array().expect("rewards");
        assert_eq!(sources.iter().filter(|s| **s == "sample").count(), 3, "{group}");
        assert_eq!(sources.len(), 3 + 6, "three samples and six chains: {group}");
        let found = sources.iter().position(|s| *s == "chain:reader>calc").expect("the chain that answered");
        assert_eq!(rewards[found], 1.0, "{group}");
        assert!(group["completions"][found].as_str().expect("plan").contains("model_id = [2, 1]"), "{group}");
        assert_eq!(rewards.iter().filter(|r| r.as_f64() == Some(1.0)).count(), 1, "{group}");
    }

    let calls = s.requests().len();
    let plans_before = s.requests().iter().filter(|r| r.model.starts_with("cond")).count();
    let after = setup.eval(&held_out, &pool, "after", strategies).await;
    assert_eq!(accuracy(&after, "conductor"), 1.0, "{:?}", after["conductor"]);
    assert_eq!(accuracy(&after, "single:calc"), 0.0);
    assert_eq!(s.requests().iter().filter(|r| r.model.starts_with("cond")).count(), plans_before, "no plan written");
    assert_eq!(after["conductor"]["figures"]["calls"], 40, "two calls per item");
    let against_best = &after["comparisons"][0];
    assert_eq!(against_best["a"], "conductor");
    assert!(against_best["mcnemar_p"].as_f64().expect("p") < 0.05, "{against_best}");
    assert!(s.requests().len() > calls);

    // `pool show` shows the workflow's figures and the route.
    let show = baton(&["pool", "show", "--pool", path(&pool), "--db", path(&setup.db)]).await;
    assert_eq!(show.code, Some(0), "{}", show.stderr);
    assert!(
        show.stdout.contains("reader, then calc seeing reader's answer: learned in learn-learn-"),
        "{}",
        show.stdout
    );
    assert!(show.stdout.contains(route), "{}", show.stdout);

    // Planning every question, the conductor is shown the workflow's plans as examples.
    let never = setup.write("never.toml", &text.replace("[conductor]\n", "[conductor]\nroute = \"never\"\n"));
    let ((item, _, _), _) = &test[0];
    let question = item["question"].as_str().expect("question");
    let out = baton(&["plan", "--json", "--pool", path(&never), "--db", path(&setup.db), question]).await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let told = s.requests().iter().rev().find(|r| r.model.starts_with("cond")).expect("a plan").body.to_string();
    assert!(told.contains("Example [learned]") && told.contains("Above is another model"), "{told}");

    // A workflow belongs to its workers as they were: change calc, and it routes nothing.
    let changed = setup.write(
        "changed.toml",
        &text.replace("name = \"calc\"\nprovider", "name = \"calc\"\ntemperature = 1\nprovider"),
    );
    let stale = setup.eval(&held_out, &changed, "stale", "conductor").await;
    assert_eq!(accuracy(&stale, "conductor"), 0.0, "calc changed: the workflow is stale");
}
