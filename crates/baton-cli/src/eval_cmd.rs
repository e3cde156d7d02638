//! `baton eval`: run strategies side by side on a suite of checkable questions and say which
//! is better, at what cost (see `baton_eval`). Results live in the history database.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use baton_eval::report::{self, Report};
use baton_eval::{Ended, Progress};
use baton_runner::LocalModels;
use baton_runner::evaluate::{self, EvalRequest};
use indicatif::{ProgressBar, ProgressStyle};
use tokio_util::sync::CancellationToken;

use crate::conductor_setup::Loader;
use crate::{Failure, Outcome, PoolArg};

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: Command,
    #[command(flatten)]
    db: crate::history_cmd::DbArg,
}

#[derive(Debug, clap::Subcommand)]
enum Command {
    /// Run (or resume) an evaluation: every strategy on the same items.
    Run(RunArgs),
    /// The evaluations in the history.
    List {
        #[arg(long)]
        json: bool,
    },
    /// An evaluation's results table (or JSON).
    Show {
        id: String,
        #[arg(long)]
        json: bool,
    },
    /// Write an evaluation's report: ID.md, ID.html, ID.svg (the cost–accuracy chart),
    /// ID.json (the summary) and ID.results.jsonl (every item's result).
    Export {
        id: String,
        /// Directory to write into (default: the current one).
        #[arg(short = 'o', long, value_name = "DIR", default_value = ".")]
        out: PathBuf,
    },
    /// Delete an evaluation, its results and its runs.
    Delete { id: String },
    /// Write the conductor's samples as training data for TRL's GRPOTrainer: one JSON line per
    /// item with the conductor's exact request as recorded with the plan, each sample's plan
    /// and its reward (1 correct, 0.5 a usable plan with a wrong answer, 0 a plan that could
    /// not be used: it failed, copied an example or kept the question from the workers). Run
    /// the evaluation with `--strategies conductor --repeats K` and `[conductor] temperature`
    /// above 0 for K different samples per item.
    ExportGrpo {
        id: String,
        /// The JSONL file to write.
        #[arg(short = 'o', long, value_name = "FILE")]
        out: PathBuf,
        /// Keep items with at least this many samples, and that many of each.
        #[arg(long, value_name = "K")]
        samples: Option<usize>,
    },
    /// Write the answers marked better in the app's chat comparisons (the conductor against one
    /// worker alone) as preference pairs: one JSON line each with `prompt` (the conversation up
    /// to the question), `chosen` and `rejected` (chat messages), the form TRL's DPOTrainer and
    /// RewardTrainer read. Ties and unmarked comparisons are left out.
    ExportPreferences {
        /// The JSONL file to write.
        #[arg(short = 'o', long, value_name = "FILE")]
        out: PathBuf,
    },
    /// The built-in suites and where they come from.
    Suites,
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    /// A built-in suite (humaneval, math500, mmlu) or a JSONL file of items.
    #[arg(required_unless_present = "from_hf", conflicts_with = "from_hf")]
    suite: Option<String>,
    /// Read the suite from a dataset on the Hugging Face hub instead: DATASET[:CONFIG[:SPLIT]]
    /// (the split defaults to `test`), e.g. openai/gsm8k:main, cais/mmlu:all,
    /// HuggingFaceH4/MATH-500, openai/openai_humaneval. Fetched once through the hub's dataset
    /// viewer and kept as a JSONL suite in the cache; later runs read that file.
    #[arg(long, value_name = "DATASET")]
    from_hf: Option<String>,
    #[command(flatten)]
    pool: PoolArg,
    #[command(flatten)]
    conductor: crate::conductor_setup::ConductorArgs,
    /// Comma-separated: conductor, single:WORKER (all-singles for every worker), moa,
    /// router:lookup, router:random, best-of-n:WORKER[:N], oracle.
    #[arg(long, default_value = evaluate::DEFAULT_STRATEGIES)]
    strategies: String,
    /// Names the evaluation; running again with the same id resumes it (default: the suite's
    /// name and the time).
    #[arg(long)]
    id: Option<String>,
    /// Evaluate this many items, drawn stratified by category (default: all).
    #[arg(long, value_name = "N")]
    limit: Option<usize>,
    /// Run every strategy this many times per item.
    #[arg(long, default_value_t = 1)]
    repeats: u32,
    /// Runs in flight at once.
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    /// Spend at most this much in total (resumes included); unpriced calls count as $0.
    #[arg(long, value_name = "USD", value_parser = crate::numbers::cost_usd)]
    max_cost_usd: Option<f64>,
    /// Share of items kept to calibrate the lookup router and choose MoA's aggregator
    /// (default 0.3 when one of them is asked for).
    #[arg(long, value_name = "FRACTION")]
    calibration: Option<f64>,
    /// Seed for sampling, splits and the random router.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Print the result as one JSON object on the last line instead of a table.
    #[arg(long)]
    json: bool,
}

pub async fn run(args: Args) -> Outcome {
    match args.command {
        Command::Suites => {
            for (name, provenance) in baton_eval::suite::builtins() {
                println!("{name:10} {provenance}");
            }
            Ok(())
        }
        Command::Run(run_args) => run_eval(run_args, &args.db).await,
        Command::List { json } => {
            let store = args.db.open().await?;
            let list = store.evaluations().await.map_err(|e| Failure::Failed(e.to_string()))?;
            for e in &list {
                if json {
                    println!("{}", crate::json::line(e));
                } else {
                    let strategies = e.config["strategies"]
                        .as_array()
                        .map(|a| a.iter().filter_map(|s| s.as_str()).collect::<Vec<_>>().join(","))
                        .unwrap_or_default();
                    println!(
                        "{}  {}  {}  {} results  ${:.4}  {}",
                        e.id, e.suite, e.status, e.results, e.spent_usd, strategies
                    );
                }
            }
            Ok(())
        }
        Command::Show { id, json } => {
            let store = args.db.open().await?;
            let report = load_report(&store, &id).await?;
            if json {
                println!("{}", crate::json::line(&report));
            } else {
                print!("{}", report::table(&report));
            }
            Ok(())
        }
        Command::Export { id, out } => {
            let store = args.db.open().await?;
            let report = load_report(&store, &id).await?;
            let results = store.eval_results(&id).await.map_err(|e| Failure::Failed(e.to_string()))?;
            std::fs::create_dir_all(&out).map_err(|e| Failure::Failed(format!("{}: {e}", out.display())))?;
            let base = safe_name(&id);
            let write = |name: String, text: String| {
                let path = out.join(name);
                std::fs::write(&path, text).map_err(|e| Failure::Failed(format!("{}: {e}", path.display())))?;
                println!("{}", path.display());
                Ok::<(), Failure>(())
            };
            let jsonl: String = results.iter().map(|r| serde_json::to_string(r).unwrap_or_default() + "\n").collect();
            write(format!("{base}.md"), report::markdown(&report, &format!("{base}.svg")))?;
            write(format!("{base}.svg"), report::svg(&report))?;
            write(format!("{base}.html"), report::html(&report))?;
            write(format!("{base}.json"), serde_json::to_string_pretty(&report).unwrap_or_default())?;
            write(format!("{base}.results.jsonl"), jsonl)?;
            Ok(())
        }
        Command::ExportGrpo { id, out, samples } => {
            let store = args.db.open().await?;
            export_grpo(&store, &id, &out, samples).await
        }
        Command::ExportPreferences { out } => {
            let store = args.db.open().await?;
            let pairs = store.preference_pairs().await.map_err(|e| Failure::Failed(e.to_string()))?;
            let text: String = pairs.iter().map(|p| serde_json::to_string(p).unwrap_or_default() + "\n").collect();
            std::fs::write(&out, text).map_err(|e| Failure::Failed(format!("{}: cannot write: {e}", out.display())))?;
            eprintln!(
                "wrote {} preference pair{} to {}",
                pairs.len(),
                if pairs.len() == 1 { "" } else { "s" },
                out.display()
            );
            Ok(())
        }
        Command::Delete { id } => {
            let store = args.db.open().await?;
            if store.delete_evaluation(&id).await.map_err(|e| Failure::Failed(e.to_string()))? {
                eprintln!("deleted evaluation {id}");
                Ok(())
            } else {
                Err(Failure::BadInput(format!("there is no evaluation {id:?} (baton eval list)")))
            }
        }
    }
}

/// One prompt's group of samples, as `export-grpo` writes it (see the schema in docs/evaluation.md).
#[derive(serde::Serialize)]
struct GrpoGroup {
    /// The conductor's exact messages (conversational form: GRPOTrainer's `prompt` column).
    prompt: Vec<serde_json::Value>,
    item_id: String,
    kind: Option<String>,
    answer: Option<String>,
    /// The question as every strategy was asked it.
    question: String,
    completions: Vec<String>,
    rewards: Vec<f64>,
    /// Where each completion comes from: `sample` (the conductor wrote it for this prompt), or
    /// the strategy key of a learning run's search candidate (`chain:a>b`, `fan-out:a+b>a`),
    /// a plan of fixed shape written as the conductor would write it, which was run and scored
    /// the same way.
    sources: Vec<String>,
    /// The runs in the history the samples come from.
    run_ids: Vec<i64>,
}

/// Whether a result is a learning run's search candidate (a workflow of fixed shape).
fn searched(strategy: &str) -> bool {
    strategy.starts_with("chain:") || strategy.starts_with("fan-out:")
}

async fn export_grpo(store: &baton_store::Store, id: &str, out: &std::path::Path, samples: Option<usize>) -> Outcome {
    let failed = |e: baton_store::StoreError| Failure::Failed(e.to_string());
    let evaluation = store
        .evaluation(id)
        .await
        .map_err(failed)?
        .ok_or_else(|| Failure::BadInput(format!("there is no evaluation {id:?} (baton eval list)")))?;
    let items: std::collections::HashMap<String, baton_eval::suite::Item> = evaluation.config["suite_source"]
        .as_str()
        .and_then(|s| baton_eval::suite::load(s).ok())
        .map(|s| s.items.into_iter().map(|i| (i.id.clone(), i)).collect())
        .unwrap_or_default();
    if items.is_empty() {
        eprintln!("warning: the suite's items cannot be read again; answers are left out");
    }
    let results = store.eval_results(id).await.map_err(failed)?;
    let mut groups: std::collections::BTreeMap<String, Vec<&baton_store::evaluations::EvalResult>> = Default::default();
    // The conductor's samples first: a group's prompt is its first sample's.
    for r in results.iter().filter(|r| r.strategy == "conductor") {
        groups.entry(r.item_id.clone()).or_default().push(r);
    }
    for r in results.iter().filter(|r| searched(&r.strategy)) {
        if let Some(group) = groups.get_mut(&r.item_id) {
            group.push(r);
        }
    }
    if groups.is_empty() {
        return Err(Failure::BadInput(format!(
            "evaluation {id} has no conductor samples; run one with --strategies conductor --repeats K"
        )));
    }
    let mut written = 0;
    let mut skipped = 0;
    let mut unrecorded = 0;
    let mut other_prompt = 0;
    let mut text = String::new();
    for (item_id, rows) in groups {
        let mut group = GrpoGroup {
            prompt: Vec::new(),
            item_id: item_id.clone(),
            kind: items.get(&item_id).map(|i| i.kind.as_str().to_owned()),
            answer: items.get(&item_id).map(|i| i.answer.clone()),
            question: String::new(),
            completions: Vec::new(),
            rewards: Vec::new(),
            sources: Vec::new(),
            run_ids: Vec::new(),
        };
        let mut first: Option<baton_engine::PlanPrompt> = None;
        for r in rows {
            let Some(run) = r.run_id else { continue };
            let Ok(Some(tree)) = store.run(run).await else {
                skipped += 1;
                continue;
            };
            // The conductor's first answer and the request it answered: the plan that ran, else
            // the first attempt that could not be used (a fallback ran instead; reward 0).
            let Some(plan) = tree.plans.iter().find(|p| p.round == 0) else {
                skipped += 1;
                continue;
            };
            // A search candidate has no request of its own: its plan is written as the conductor
            // writes one, a completion for the group's prompt.
            if searched(&r.strategy) {
                if first.is_none() {
                    continue;
                }
                group.completions.push(format!("```python\n{}```", plan.plan.to_python()));
                group.rewards.push(if r.correct { 1.0 } else { 0.5 });
                group.sources.push(r.strategy.clone());
                group.run_ids.push(run);
                continue;
            }
            let (sample, reward) = match plan.rejected.first() {
                Some(rejected) => ((rejected.prompt.clone(), rejected.raw.clone()), 0.0),
                None => ((plan.prompt.clone(), plan.raw.clone()), if r.correct { 1.0 } else { 0.5 }),
            };
            let (Some(prompt), Some(raw)) = sample else {
                // Written before requests were kept, or a plan that never came.
                unrecorded += 1;
                continue;
            };
            // A group shares one prompt (GRPO compares answers to the same request).
            match &first {
                Some(p) if *p != prompt => {
                    other_prompt += 1;
                    continue;
                }
                Some(_) => {}
                None => {
                    group.prompt.push(serde_json::json!({"role": "system", "content": prompt.system}));
                    for m in &prompt.messages {
                        group.prompt.push(serde_json::to_value(m).unwrap_or_default());
                    }
                    group.question = tree.run.question.clone();
                    first = Some(prompt);
                }
            }
            group.completions.push(raw);
            group.rewards.push(reward);
            group.sources.push("sample".into());
            group.run_ids.push(run);
        }
        if let Some(k) = samples {
            if group.completions.len() < k {
                skipped += group.completions.len();
                continue;
            }
            group.completions.truncate(k);
            group.rewards.truncate(k);
            group.sources.truncate(k);
            group.run_ids.truncate(k);
        }
        if group.completions.is_empty() {
            continue;
        }
        text.push_str(&serde_json::to_string(&group).unwrap_or_default());
        text.push('\n');
        written += 1;
    }
    std::fs::write(out, text).map_err(|e| Failure::Failed(format!("{}: {e}", out.display())))?;
    eprintln!(
        "{written} prompts written to {}, from the results of strategy `conductor` (the samples) and, in a learning run, `chain:…` and `fan-out:…` (search candidates); {skipped} samples left out (no plan, or too few samples)",
        out.display()
    );
    if unrecorded > 0 {
        eprintln!(
            "{unrecorded} samples left out: their plans were recorded without the conductor's request (before this version of Baton kept it)"
        );
    }
    if other_prompt > 0 {
        eprintln!(
            "{other_prompt} samples left out: the conductor was asked them in other words than its group's first"
        );
    }
    Ok(())
}

/// A file name from an evaluation id (ids are the user's words).
fn safe_name(id: &str) -> String {
    id.chars().map(|c| if c.is_alphanumeric() || matches!(c, '-' | '_' | '.') { c } else { '_' }).collect()
}

async fn load_report(store: &baton_store::Store, id: &str) -> Result<Report, Failure> {
    Ok(evaluate::results(store, id).await?.report)
}

/// The suite a `--from-hf DATASET[:CONFIG[:SPLIT]]` names, as a JSONL file in the cache
/// (`<cache>/baton/datasets/`): fetched through the hub's dataset viewer the first time, read
/// from the file after (so a resumed evaluation sees the same items, offline too).
async fn hf_suite(spec: &str, quiet: bool) -> Result<String, Failure> {
    let mut parts = spec.splitn(3, ':');
    let dataset = parts.next().unwrap_or_default().trim();
    if dataset.split('/').filter(|p| !p.is_empty()).count() > 2 || dataset.is_empty() {
        return Err(Failure::BadInput(format!("{spec:?}: name a dataset as OWNER/NAME[:CONFIG[:SPLIT]]")));
    }
    let (config, split) = (parts.next().filter(|c| !c.is_empty()), parts.next().filter(|s| !s.is_empty()));
    let server = baton_models::datasets::DatasetsServer::from_env(|endpoint| {
        let store = baton_secrets::KeyStore::open().ok()?;
        let key = store.get(&baton_models::token_account(endpoint)).ok()??;
        Some(key.expose().to_owned())
    });
    // File names from what the user or the server named: nothing that could leave the folder.
    let safe = |s: &str| -> String {
        let kept: String =
            s.chars().map(|c| if c.is_ascii_alphanumeric() || "-_.".contains(c) { c } else { '_' }).collect();
        kept.replace("..", "__")
    };
    let dir = dirs::cache_dir()
        .unwrap_or_else(|| ".".into())
        .join("baton")
        .join("datasets")
        .join(safe(&dataset.replace('/', "__")));
    // Named before the split is resolved, so a file made earlier is found without the network.
    let guess = dir.join(format!("{}__{}.jsonl", safe(config.unwrap_or("_")), safe(split.unwrap_or("_"))));
    if guess.exists() {
        return Ok(guess.display().to_string());
    }
    let failed = |e: baton_models::datasets::DatasetError| Failure::BadInput(e.to_string());
    let chosen = server.choose(dataset, config, split).await.map_err(failed)?;
    if !quiet {
        eprintln!("reading {dataset} ({}/{}) from {}", chosen.config, chosen.split, server.server());
    }
    let rows = server
        .rows(dataset, &chosen, |done, total| {
            if !quiet {
                eprint!("\r{done}/{total} rows");
            }
        })
        .await
        .map_err(failed)?;
    if !quiet {
        eprintln!();
    }
    let name = format!("{}-{}", dataset.rsplit('/').next().unwrap_or(dataset), chosen.split);
    let suite = baton_eval::hf::suite_from_rows(&name, dataset, &rows).map_err(|e| Failure::BadInput(e.to_string()))?;
    let text: String = suite.items.iter().map(|i| serde_json::to_string(i).unwrap_or_default() + "\n").collect();
    std::fs::create_dir_all(&dir).map_err(|e| Failure::Failed(format!("{}: cannot create: {e}", dir.display())))?;
    // Kept under the name asked for (found again offline) and under the split it resolved to.
    let resolved = dir.join(format!("{}__{}.jsonl", safe(&chosen.config), safe(&chosen.split)));
    let names: &[&std::path::PathBuf] = if resolved == guess { &[&resolved] } else { &[&resolved, &guess] };
    for path in names {
        let partial = path.with_extension("jsonl.partial");
        std::fs::write(&partial, &text)
            .and_then(|()| std::fs::rename(&partial, path))
            .map_err(|e| Failure::Failed(format!("{}: cannot write: {e}", path.display())))?;
    }
    if !quiet {
        eprintln!("{} items kept in {}", suite.items.len(), resolved.display());
    }
    Ok(resolved.display().to_string())
}

async fn run_eval(mut args: RunArgs, db: &crate::history_cmd::DbArg) -> Outcome {
    if let Some(spec) = &args.from_hf {
        args.suite = Some(hf_suite(spec, args.json).await?);
    }
    let source = args.suite.clone().unwrap_or_default();
    let pool = args.pool.load()?;
    let request = EvalRequest {
        suite: source.clone(),
        strategies: args.strategies.clone(),
        id: args.id.clone(),
        limit: args.limit,
        repeats: args.repeats,
        concurrency: args.concurrency,
        max_cost_usd: args.max_cost_usd,
        calibration: args.calibration,
        seed: args.seed,
    };
    // The history opens before anything runs, so a database problem costs no calls.
    let store = db.open().await?;
    let io = crate::io::Io::terminal();
    let loader = Loader::new(&args.conductor, args.json, &io);
    let models = LocalModels::default();
    let context = loader.context(&pool, &models);
    let watch = Watch::new("evaluation", args.json);
    let evaluated = evaluate::evaluate(pool, &store, &request, context, &|p| watch.show(p), &watch.cancel).await;
    watch.finish();
    let evaluated = match evaluated {
        Ok(evaluated) => evaluated,
        Err(e) => {
            store.close().await;
            return Err(e.into());
        }
    };
    let id = evaluated.id;
    let report = evaluate::results(&store, &id).await.map(|r| r.report);
    store.close().await;
    let report = report?;
    if args.json {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{}", crate::json::line(&report));
    } else {
        print!("{}", report::table(&report));
    }
    // How to go on, named as the user named the suite.
    let named = match &args.from_hf {
        Some(spec) => format!("--from-hf {spec}"),
        None => source.clone(),
    };
    match evaluated.ended {
        Ended::Finished => Ok(()),
        Ended::Stopped => {
            eprintln!("stopped; `baton eval run {named} --id {id}` with the same settings goes on");
            Err(Failure::Interrupted)
        }
        Ended::OverBudget => Err(Failure::Failed(format!(
            "the spending cap was reached; `baton eval run {named} --id {id} --max-cost-usd <more>` goes on"
        ))),
    }
}

/// Watching a long run from the terminal: its progress bar (none when `quiet`: JSON on
/// stdout), and a stop on the first Ctrl-C.
pub(crate) struct Watch {
    /// What is watched ("evaluation", "learning"), as its first line names it.
    what: &'static str,
    bar: Bar,
    pub(crate) cancel: CancellationToken,
    ctrl_c: tokio::task::JoinHandle<()>,
}

impl Watch {
    pub(crate) fn new(what: &'static str, quiet: bool) -> Watch {
        let cancel = CancellationToken::new();
        let ctrl_c = crate::cancel_on_ctrl_c(&cancel);
        Watch { what, bar: Bar::new(quiet), cancel, ctrl_c }
    }

    pub(crate) fn show(&self, p: Progress) {
        match p {
            Progress::Started { id, about } => self.bar.note(format!("{} {id}: {about}", self.what)),
            p => self.bar.show(p),
        }
    }

    /// Once the run has ended.
    pub(crate) fn finish(self) {
        self.bar.finish();
        self.ctrl_c.abort();
    }
}

/// The progress bar: runs done, ETA, accuracy so far per strategy, and spend.
struct Bar {
    bar: Option<ProgressBar>,
    tally: Mutex<std::collections::BTreeMap<String, (u32, u32)>>,
}

impl Bar {
    fn new(quiet: bool) -> Bar {
        let bar = (!quiet).then(|| {
            let bar = if std::io::stderr().is_terminal() { ProgressBar::new(0) } else { ProgressBar::hidden() };
            bar.set_style(
                ProgressStyle::with_template("{bar:30} {pos}/{len} runs, {eta} left · {msg}")
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            bar.enable_steady_tick(Duration::from_millis(500));
            bar
        });
        Bar { bar, tally: Mutex::new(Default::default()) }
    }

    fn show(&self, p: Progress) {
        let Some(bar) = &self.bar else {
            // Quiet (JSON on stdout): notes still go to stderr.
            if let Progress::Started { about: note, .. } | Progress::Note(note) = p {
                eprintln!("{note}");
            }
            return;
        };
        match p {
            Progress::Planned { total, done } => {
                bar.set_length(total as u64);
                bar.set_position(done as u64);
            }
            Progress::Scored { strategy, correct, spent_usd, .. } => {
                bar.inc(1);
                let mut tally = self.tally.lock().unwrap_or_else(|e| e.into_inner());
                let t = tally.entry(strategy).or_default();
                t.0 += u32::from(correct);
                t.1 += 1;
                let parts: Vec<String> = tally
                    .iter()
                    .map(|(s, (c, n))| format!("{s} {:.0}%", 100.0 * f64::from(*c) / f64::from((*n).max(1))))
                    .collect();
                bar.set_message(format!("{} · ${spent_usd:.4}", parts.join(" · ")));
                if bar.is_hidden() {
                    // Not a terminal (a log, CI): one line per run instead of a bar.
                    eprintln!("[{}/{}] {}", bar.position(), bar.length().unwrap_or(0), bar.message());
                }
            }
            Progress::Started { about: note, .. } | Progress::Note(note) => bar.suspend(|| eprintln!("{note}")),
        }
    }

    /// A line for the user, above the bar.
    fn note(&self, note: String) {
        self.show(Progress::Note(note));
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}
