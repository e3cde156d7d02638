//! Runs and conversations as Markdown (to read or share) and as JSON (to process).
//!
//! The JSON shape is stable and versioned by its `format` field:
//!
//! - `{"format": "baton-run/1", "run": {...}, "plans": [...], "steps": [...], "events": [...]}`:
//!   `run` has `id`, `uid`, `conversation_id`, `question`, `conductor`, `workers` (`index`,
//!   `name`, `provider`, `model`, `description`), `status` (`running`, `finished`, `failed`,
//!   `cancelled`, `interrupted`), `answer`, `error_kind`, `error`, `started_at`, `finished_at`
//!   (Unix ms), `rounds`, `calls`, `input_tokens`, `output_tokens`, `cost_usd`,
//!   `cost_complete`, `totals` (the run's `Totals` as `run_finished` carries them: the conductor's
//!   and the workers' shares, cached tokens, `cost_unknown_for`; null for runs recorded before
//!   they were kept), `wall_ms`, `rerun_of` (`{run_id, step}` for a run that re-ran one step of
//!   an earlier run with another worker, else null). Each plan: `round`, `depth`, `parent` (`{round, step}` or
//!   null), `raw` (the conductor's text or null), `plan` (`model_id`, `subtasks`,
//!   `access_list`, as `baton plan parse` prints). Each step: `round`, `step`, `worker_index`,
//!   `worker`, `subtask`, `access` (`"all"` or step numbers), `request` (`system`, `messages`
//!   with `role` and `content`: exactly what the worker was sent, or null), `status`
//!   (`running`, `finished`, `failed`, `cancelled`: the run stopped while the step waited or
//!   answered, and `output` is the text that had arrived, cut short; `interrupted`),
//!   `output`, `error_kind`, `error`, `input_tokens`, `cached_input_tokens`,
//!   `cache_write_input_tokens`, `output_tokens`, `cost_usd`,
//!   `latency_ms`, `retries`, `reused_from` (for a step a re-run kept rather than ran: the run
//!   id its output comes from; else null). `events` are the run's `RunEvent`s without text deltas, as
//!   `baton ask --json` prints them.
//! - `{"format": "baton-conversation/1", "id", "title", "messages": [{role, content}],
//!   "runs": [<baton-run/1 objects>]}`. `messages` alternate user and assistant: a question
//!   whose run gave no answer is followed by an assistant turn saying so ("(no answer: the run
//!   was stopped before it finished)").

use std::fmt::Write;

use baton_plan::Access;
use baton_providers::Message;
use serde_json::{Value, json};

use crate::time::utc;
use crate::{RunTree, StepRecord};

pub const RUN_FORMAT: &str = "baton-run/1";
pub const CONVERSATION_FORMAT: &str = "baton-conversation/1";

pub fn run_json(tree: &RunTree) -> Value {
    let mut value = serde_json::to_value(tree).unwrap_or(Value::Null);
    if let Value::Object(map) = &mut value {
        map.insert("format".into(), RUN_FORMAT.into());
    }
    value
}

pub fn conversation_json(id: i64, title: &str, messages: &[Message], runs: &[RunTree]) -> Value {
    json!({
        "format": CONVERSATION_FORMAT,
        "id": id,
        "title": title,
        "messages": messages,
        "runs": runs.iter().map(run_json).collect::<Vec<_>>(),
    })
}

/// One run: question, answer, then each round's plan and each step with what it was asked
/// and answered.
pub fn run_markdown(tree: &RunTree) -> String {
    let mut md = String::new();
    write_run(&mut md, tree, "#");
    md
}

pub fn conversation_markdown(title: &str, runs: &[RunTree]) -> String {
    let mut md = format!("# {}\n", one_line(title));
    for tree in runs {
        md.push('\n');
        write_run(&mut md, tree, "##");
    }
    md
}

fn write_run(md: &mut String, tree: &RunTree, h: &str) {
    let r = &tree.run;
    let _ = writeln!(md, "{h} {}\n", one_line(&r.question));
    let mut facts = vec![format!("Run {}", r.id), r.status.as_str().to_owned(), utc(r.started_at)];
    if let Some(ms) = r.wall_ms {
        facts.push(format!("{:.1} s", ms as f64 / 1000.0));
    }
    match &r.totals {
        Some(totals) => {
            let _ = writeln!(md, "*{}*\n", facts.join(" · "));
            for line in totals.breakdown() {
                let _ = writeln!(md, "- {line}");
            }
            md.push('\n');
        }
        // Recorded before the split was kept: the flat figures.
        None => {
            facts.push(format!("{} calls", r.calls));
            facts.push(format!("{} in / {} out tokens", r.input_tokens, r.output_tokens));
            let cost = if r.cost_complete { format!("${:.4}", r.cost_usd) } else { format!("≥ ${:.4}", r.cost_usd) };
            facts.push(cost);
            let _ = writeln!(md, "*{}*\n", facts.join(" · "));
        }
    }
    if let Some(c) = &r.conductor {
        let _ = writeln!(md, "Conductor: {c}\n");
    }
    if let Some(rerun) = &r.rerun_of {
        let _ = writeln!(md, "Re-runs step {} of run {} with another worker.\n", rerun.step, rerun.run_id);
    }
    if r.question.contains('\n') {
        let _ = writeln!(md, "{h}# Question\n\n{}\n", r.question.trim_end());
    }
    match (&r.answer, &r.error) {
        (Some(answer), _) => {
            let _ = writeln!(md, "{h}# Answer\n\n{}\n", answer.trim_end());
        }
        (None, Some(error)) => {
            let _ = writeln!(md, "{h}# Error\n\n{}\n", error.trim_end());
        }
        (None, None) => {}
    }
    for plan in &tree.plans {
        let origin = match plan.parent {
            Some(p) => format!(" (from round {} step {}, depth {})", p.round, p.step, plan.depth),
            None => String::new(),
        };
        let _ = writeln!(md, "{h}# Plan, round {}{origin}\n", plan.round);
        for rejected in &plan.rejected {
            let _ = writeln!(md, "> The conductor's plan was not used: {}\n", one_line(&rejected.reason));
        }
        if let Some(why) = &plan.fallback {
            let _ = writeln!(md, "**Fallback:** {}.\n", one_line(why));
        }
        let _ = writeln!(md, "```python\n{}```\n", plan.plan.to_python());
        for step in tree.steps.iter().filter(|s| s.round == plan.round) {
            write_step(md, step, h);
        }
    }
}

fn write_step(md: &mut String, s: &StepRecord, h: &str) {
    let mut facts = vec![s.status.clone()];
    if let (Some(i), Some(o)) = (s.input_tokens, s.output_tokens) {
        match s.cached_input_tokens.filter(|c| *c > 0) {
            Some(c) => facts.push(format!("{i} in ({c} cached) / {o} out tokens")),
            None => facts.push(format!("{i} in / {o} out tokens")),
        }
    }
    if let Some(ms) = s.latency_ms {
        facts.push(format!("{:.1} s", ms as f64 / 1000.0));
    }
    if let Some(c) = s.cost_usd {
        facts.push(format!("${c:.4}"));
    }
    if s.retries > 0 {
        facts.push(format!("{} retries", s.retries));
    }
    if let Some(run) = &s.reused_from {
        facts.push(format!("kept from run {run}, not run again"));
    }
    let access = match &s.access {
        Access::All => "all earlier steps".to_owned(),
        Access::Steps(v) if v.is_empty() => "no earlier steps".to_owned(),
        Access::Steps(v) => format!("steps {}", v.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")),
    };
    let _ = writeln!(md, "{h}## Step {} · {} ({})\n", s.step, s.worker, facts.join(", "));
    let _ = writeln!(md, "Sees {access}. Subtask: {}\n", one_line(&s.subtask));
    if let Some(output) = &s.output {
        let _ = writeln!(md, "{}\n", output.trim_end());
        if s.status == "cancelled" {
            let _ = writeln!(md, "*(cut short: the run stopped while this step was answering)*\n");
        }
    }
    if let Some(error) = &s.error {
        let kind = s.error_kind.as_deref().unwrap_or("error");
        let _ = writeln!(md, "> {kind}: {}\n", one_line(error));
    }
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}
