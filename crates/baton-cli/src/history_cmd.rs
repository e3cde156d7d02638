//! `baton history`: list, search, show, export and delete recorded runs.

use std::io::Write;
use std::path::PathBuf;

use baton_store::{RunTree, Store, export};
use serde_json::json;

use crate::{Failure, Outcome};

/// The history database: `--db`, else `$BATON_DB`, else `<data dir>/baton/history.sqlite`.
#[derive(Debug, Clone, clap::Args)]
pub struct DbArg {
    /// History database (SQLite).
    #[arg(long, value_name = "FILE", env = "BATON_DB", global = true)]
    db: Option<PathBuf>,
}

impl DbArg {
    pub fn path(&self) -> PathBuf {
        self.db.clone().unwrap_or_else(|| baton_store::default_path(&dirs::data_dir().unwrap_or_else(|| ".".into())))
    }

    pub async fn open(&self) -> Result<Store, Failure> {
        Store::open(&self.path()).await.map_err(|e| Failure::BadInput(e.to_string()))
    }
}

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: Command,
    #[command(flatten)]
    db: DbArg,
}

#[derive(Debug, clap::Subcommand)]
enum Command {
    /// Recorded runs, newest first.
    List {
        /// How many runs.
        #[arg(long, default_value_t = 20)]
        limit: u32,
        /// Only runs older than this one (the last id of the previous page).
        #[arg(long, value_name = "RUN")]
        before: Option<i64>,
        /// Conversations instead of runs.
        #[arg(long)]
        conversations: bool,
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
    },
    /// Runs whose question, answer or subtasks contain every word (the last also as a prefix).
    Search {
        query: String,
        #[arg(long, default_value_t = 20)]
        limit: u32,
        #[arg(long)]
        json: bool,
    },
    /// A run's whole record: question, answer, each round's plan, each step.
    Show {
        run: i64,
        /// The JSON export instead of Markdown.
        #[arg(long)]
        json: bool,
    },
    /// A run, or a whole conversation, as Markdown or JSON.
    Export {
        /// The run to export.
        #[arg(required_unless_present = "conversation", conflicts_with = "conversation")]
        run: Option<i64>,
        /// Export this conversation (all its runs) instead.
        #[arg(long, value_name = "ID")]
        conversation: Option<i64>,
        #[arg(long, value_enum, default_value_t = Format::Md)]
        format: Format,
        /// Write to this file instead of stdout.
        #[arg(long, short, value_name = "FILE")]
        output: Option<PathBuf>,
        /// Same as --format json.
        #[arg(long)]
        json: bool,
    },
    /// Per worker over the whole history: calls, failure rate, latency p50/p95, tokens, $, and
    /// its accuracy alone in the newest evaluation that ran it.
    Workers {
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
    },
    /// Delete a run (with its question and answer in the conversation), or a whole conversation.
    Delete {
        #[arg(required_unless_present = "conversation", conflicts_with = "conversation")]
        run: Option<i64>,
        #[arg(long, value_name = "ID")]
        conversation: Option<i64>,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Format {
    Md,
    Json,
}

pub async fn run(args: Args) -> Outcome {
    let store = args.db.open().await?;
    let result = command(&store, args.command).await;
    store.close().await;
    result
}

async fn command(store: &Store, command: Command) -> Outcome {
    let failed = |e: baton_store::StoreError| Failure::Failed(e.to_string());
    let mut out = std::io::stdout().lock();
    match command {
        Command::List { limit, before, conversations: true, json } => {
            for c in store.list_conversations(limit, before).await.map_err(failed)? {
                if json {
                    line(&mut out, &json!(c))?;
                } else {
                    let when = baton_store::time::utc(c.updated_at);
                    write_out(&mut out, &format!("{:>6}  {}  {:>3} runs  {}", c.id, &when[..16], c.runs, c.title))?;
                }
            }
        }
        Command::List { limit, before, conversations: false, json } => {
            for r in store.list_runs(limit, before).await.map_err(failed)? {
                if json {
                    line(&mut out, &json!(r))?;
                } else {
                    let when = baton_store::time::utc(r.started_at);
                    let text = format!(
                        "{:>6}  {:<11}  {}  {:>3} calls  {}",
                        r.id,
                        r.status.as_str(),
                        &when[..16],
                        r.calls,
                        first_line(&r.question)
                    );
                    write_out(&mut out, &text)?;
                }
            }
        }
        Command::Search { query, limit, json } => {
            let hits = store.search(&query, limit).await.map_err(failed)?;
            for h in &hits {
                if json {
                    line(&mut out, &json!(h))?;
                } else {
                    let text = format!(
                        "{:>6}  {:<11}  {}\n        {}: {}",
                        h.id,
                        h.status.as_str(),
                        first_line(&h.question),
                        h.matched,
                        first_line(&h.snippet)
                    );
                    write_out(&mut out, &text)?;
                }
            }
            if hits.is_empty() && !json {
                eprintln!("no run matches {query:?}");
            }
        }
        Command::Show { run, json } => {
            let tree = load(store, run).await?;
            if json {
                line(&mut out, &export::run_json(&tree))?;
            } else {
                write_out(&mut out, export::run_markdown(&tree).trim_end())?;
            }
        }
        Command::Export { run, conversation, format, output, json } => {
            let format = if json { Format::Json } else { format };
            let text = match (run, conversation) {
                (Some(run), _) => {
                    let tree = load(store, run).await?;
                    match format {
                        Format::Md => export::run_markdown(&tree),
                        Format::Json => pretty(&export::run_json(&tree)),
                    }
                }
                (None, Some(id)) => {
                    let title =
                        store.conversation_title(id).await.map_err(failed)?.ok_or_else(|| {
                            Failure::BadInput(format!("there is no conversation {id} in the history"))
                        })?;
                    let mut trees = Vec::new();
                    for r in store.conversation_runs(id).await.map_err(failed)? {
                        trees.push(load(store, r.id).await?);
                    }
                    match format {
                        Format::Md => export::conversation_markdown(&title, &trees),
                        Format::Json => {
                            let messages = store.messages(id).await.map_err(failed)?;
                            pretty(&export::conversation_json(id, &title, &messages, &trees))
                        }
                    }
                }
                (None, None) => return Err(Failure::BadInput("name a run or --conversation ID".into())),
            };
            match output {
                Some(path) => std::fs::write(&path, text)
                    .map_err(|e| Failure::Failed(format!("{}: cannot write: {e}", path.display())))?,
                None => write_out(&mut out, text.trim_end())?,
            }
        }
        Command::Workers { json } => {
            let figures = store.worker_figures().await.map_err(failed)?;
            if json {
                for f in &figures {
                    line(&mut out, &json!(f))?;
                }
            } else if figures.is_empty() {
                eprintln!("the history has no calls yet");
            } else {
                write_out(&mut out, &worker_table(&figures))?;
            }
        }
        Command::Delete { run, conversation, json } => {
            // A run still going is refused: stop it first (exit 2, like other bad input).
            let refused = |e: baton_store::StoreError| match e {
                baton_store::StoreError::RunStillGoing { .. }
                | baton_store::StoreError::ConversationStillGoing { .. } => Failure::BadInput(e.to_string()),
                e => failed(e),
            };
            let (what, id, deleted) = match (run, conversation) {
                (Some(run), _) => ("run", run, store.delete_run(run).await.map_err(refused)?),
                (None, Some(c)) => ("conversation", c, store.delete_conversation(c).await.map_err(refused)?),
                (None, None) => return Err(Failure::BadInput("name a run or --conversation ID".into())),
            };
            if !deleted {
                return Err(Failure::BadInput(format!("there is no {what} {id} in the history")));
            }
            if json {
                line(&mut out, &json!({ "id": id, "kind": what, "deleted": true }))?;
            } else {
                eprintln!("deleted {what} {id}");
            }
        }
    }
    Ok(())
}

fn worker_table(figures: &[baton_store::figures::WorkerFigures]) -> String {
    let ms = |v: Option<u64>| v.map_or("—".to_owned(), |v| format!("{v} ms"));
    let mut rows =
        vec![["worker", "calls", "failed", "p50", "p95", "tokens in/out", "$", "accuracy alone"].map(str::to_owned)];
    for f in figures {
        let failed = match f.failure_rate {
            Some(r) => format!("{} ({:.1}%)", f.failed, r * 100.0),
            None => f.failed.to_string(),
        };
        let accuracy = f.evaluation.as_ref().map_or("—".to_owned(), |e| {
            format!("{:.1}% of {} ({}, {})", e.accuracy * 100.0, e.n, e.suite, e.evaluation_id)
        });
        rows.push([
            f.worker.clone(),
            f.calls.to_string(),
            failed,
            ms(f.latency_p50_ms),
            ms(f.latency_p95_ms),
            format!("{}/{}", f.input_tokens, f.output_tokens),
            format!("{:.4}{}", f.cost_usd, if f.cost_complete { "" } else { "+" }),
            accuracy,
        ]);
    }
    let widths: Vec<usize> = (0..8).map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0)).collect();
    let mut text = String::new();
    for row in &rows {
        let cells: Vec<String> =
            row.iter()
                .enumerate()
                .map(|(c, v)| {
                    if c == 0 || c == 7 { format!("{v:<w$}", w = widths[c]) } else { format!("{v:>w$}", w = widths[c]) }
                })
                .collect();
        text.push_str(cells.join("  ").trim_end());
        text.push('\n');
    }
    if figures.iter().any(|f| !f.cost_complete) {
        text.push_str("+: some calls had no known price; the cost is a lower bound\n");
    }
    text.trim_end().to_owned()
}

async fn load(store: &Store, run: i64) -> Result<RunTree, Failure> {
    store.run(run).await.map_err(|e| Failure::Failed(e.to_string()))?.ok_or_else(|| {
        Failure::BadInput(format!("there is no run {run} in the history; `baton history list` shows them"))
    })
}

fn first_line(s: &str) -> String {
    let line = s.lines().find(|l| !l.trim().is_empty()).unwrap_or("").trim();
    match line.char_indices().nth(100) {
        Some((cut, _)) => format!("{}…", &line[..cut]),
        None => line.to_owned(),
    }
}

/// An export, with the version of the command line's JSON (docs/json.md).
fn pretty(value: &serde_json::Value) -> String {
    crate::json::pretty(value)
}

/// One object of a `--json` output, with its version (docs/json.md).
fn line(out: &mut impl Write, value: &serde_json::Value) -> Outcome {
    write_out(out, &crate::json::line(value))
}

/// A closed stdout (`| head`) ends the listing quietly.
fn write_out(out: &mut impl Write, text: &str) -> Outcome {
    match writeln!(out, "{text}") {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(Failure::Failed(format!("cannot write: {e}"))),
        _ => Ok(()),
    }
}
