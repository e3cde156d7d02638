//! What an evaluation found: per strategy accuracy, cost, tokens and latency on the test
//! split; paired comparisons of the conductor with the best single worker and with the lookup
//! router; the cost–accuracy Pareto front and its AIQ. As a table, JSON, Markdown, HTML and
//! an SVG chart.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;

use baton_engine::accounting::{Figures, Usage};
use baton_store::evaluations::{EvalResult, Evaluation};
use serde::Serialize;

use crate::stats;

#[derive(Debug, Clone, PartialEq, Serialize, ts_rs::TS)]
pub struct StrategySummary {
    pub strategy: String,
    /// Mean over test items of each item's mean over repeats.
    pub accuracy: f64,
    /// Standard error of `accuracy` over items.
    pub stderr: f64,
    /// Test items scored.
    pub n: usize,
    /// Runs scored (items × repeats).
    pub runs: usize,
    /// Every run's calls, tokens and dollars, summed. `cost_complete` is false when some call
    /// had no known price: `cost_usd` is then a lower bound.
    pub figures: Figures,
    /// The conductor's share of the tokens.
    pub conductor_usage: Usage,
    pub cost_per_item_usd: f64,
    pub latency_p50_ms: u64,
    pub latency_p95_ms: u64,
    /// Conductor runs: the share whose plan could be run.
    pub plan_validity: Option<f64>,
    /// Steps per run (every round).
    pub mean_steps: Option<f64>,
    /// Runs that failed (no answer).
    pub failures: usize,
    /// On the cost–accuracy Pareto front.
    pub pareto: bool,
}

impl StrategySummary {
    /// Input and output tokens per run: the cost axis where dollars say nothing.
    pub fn tokens_per_run(&self) -> f64 {
        self.figures.usage.total() as f64 / self.runs.max(1) as f64
    }
}

/// `a` against `b` on the items both were scored on.
#[derive(Debug, Clone, PartialEq, Serialize, ts_rs::TS)]
pub struct Comparison {
    pub a: String,
    pub b: String,
    pub pairs: usize,
    /// Items only `a` got right, and only `b` (an item counts as right when at least half its
    /// repeats are): McNemar's discordant pairs, one per item.
    pub only_a: u64,
    pub only_b: u64,
    pub mcnemar_p: f64,
    pub difference: f64,
    pub bootstrap_low: f64,
    pub bootstrap_high: f64,
    pub bootstrap_p: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, ts_rs::TS)]
pub struct Report {
    pub id: String,
    pub suite: String,
    pub status: String,
    pub spent_usd: f64,
    pub strategies: Vec<StrategySummary>,
    pub comparisons: Vec<Comparison>,
    /// The x axis of the front: `usd` per item, or `tokens` per item when some strategy's cost
    /// is unknown or every cost is zero (local models).
    pub cost_axis: String,
    pub pareto_front: Vec<String>,
    /// RouterBench's AIQ of all strategies together.
    pub aiq: f64,
    pub config: serde_json::Value,
}

/// Builds the report from the stored results (test split only).
pub fn summarize(evaluation: &Evaluation, results: &[EvalResult]) -> Report {
    let order: Vec<String> = evaluation.config["strategies"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str())
                .map(|s| {
                    // best-of-n:W:N is stored as best-of-n:W.
                    match s.strip_prefix("best-of-n:").and_then(|r| r.rsplit_once(':')) {
                        Some((w, n)) if n.parse::<u32>().is_ok() => format!("best-of-n:{w}"),
                        _ => s.to_owned(),
                    }
                })
                .collect()
        })
        .unwrap_or_default();
    let mut by: BTreeMap<&str, Vec<&EvalResult>> = BTreeMap::new();
    for r in results.iter().filter(|r| r.split == "test") {
        by.entry(r.strategy.as_str()).or_default().push(r);
    }
    // Requested strategies first, in the order asked; singles run for the routers after.
    let mut names: Vec<String> = order.iter().filter(|s| by.contains_key(s.as_str())).cloned().collect();
    for k in by.keys() {
        if !names.iter().any(|n| n == k) {
            names.push((*k).to_owned());
        }
    }
    let mut strategies: Vec<StrategySummary> = names.iter().map(|name| summary(name, &by[name.as_str()])).collect();

    let priced =
        strategies.iter().all(|s| s.figures.cost_complete) && strategies.iter().any(|s| s.figures.cost_usd > 0.0);
    let x = |s: &StrategySummary| if priced { s.cost_per_item_usd } else { s.tokens_per_run() };
    let points: Vec<(f64, f64)> = strategies.iter().map(|s| (x(s), s.accuracy)).collect();
    // The oracle is a ceiling, not something one can run: it is drawn but kept off the front.
    let real: Vec<usize> = (0..strategies.len()).filter(|&i| strategies[i].strategy != "oracle").collect();
    let real_points: Vec<(f64, f64)> = real.iter().map(|&i| points[i]).collect();
    let front: Vec<usize> = stats::pareto_front(&real_points).into_iter().map(|k| real[k]).collect();
    for &i in &front {
        strategies[i].pareto = true;
    }
    let aiq = stats::aiq(&real_points);

    let mut comparisons = Vec::new();
    if by.contains_key("conductor") {
        let best_single = strategies
            .iter()
            .filter(|s| s.strategy.starts_with("single:"))
            .max_by(|a, b| a.accuracy.total_cmp(&b.accuracy).then(b.cost_per_item_usd.total_cmp(&a.cost_per_item_usd)))
            .map(|s| s.strategy.clone());
        for other in best_single.into_iter().chain(by.contains_key("router:lookup").then(|| "router:lookup".to_owned()))
        {
            comparisons.push(compare("conductor", &other, &by, evaluation));
        }
    }
    Report {
        id: evaluation.id.clone(),
        suite: evaluation.suite.clone(),
        status: evaluation.status.clone(),
        spent_usd: evaluation.spent_usd,
        strategies,
        comparisons,
        cost_axis: if priced { "usd" } else { "tokens" }.into(),
        pareto_front: front.iter().map(|&i| names[i].clone()).collect(),
        aiq,
        config: evaluation.config.clone(),
    }
}

fn summary(name: &str, rows: &[&EvalResult]) -> StrategySummary {
    let mut per_item: BTreeMap<&str, (f64, u32)> = BTreeMap::new();
    for r in rows {
        let e = per_item.entry(r.item_id.as_str()).or_default();
        e.0 += f64::from(u8::from(r.correct));
        e.1 += 1;
    }
    let scores: Vec<f64> = per_item.values().map(|(c, n)| c / f64::from(*n)).collect();
    let latencies: Vec<u64> = rows.iter().map(|r| r.latency_ms).collect();
    let figures = rows.iter().fold(Figures::default(), |sum, r| sum.plus(&r.figures));
    let mut conductor_usage = Usage::default();
    for r in rows {
        conductor_usage += r.conductor_usage;
    }
    let conductor = name == "conductor";
    let steps: Vec<f64> = rows.iter().filter_map(|r| r.steps).map(f64::from).collect();
    StrategySummary {
        strategy: name.to_owned(),
        accuracy: stats::mean(&scores),
        stderr: stats::standard_error(&scores),
        n: per_item.len(),
        runs: rows.len(),
        cost_per_item_usd: figures.cost_usd / rows.len().max(1) as f64,
        figures,
        conductor_usage,
        latency_p50_ms: stats::percentile(&latencies, 50.0),
        latency_p95_ms: stats::percentile(&latencies, 95.0),
        plan_validity: conductor
            .then(|| rows.iter().filter(|r| r.plan_valid == Some(true)).count() as f64 / rows.len().max(1) as f64),
        mean_steps: (conductor && !steps.is_empty()).then(|| stats::mean(&steps)),
        failures: rows.iter().filter(|r| r.answer.is_none()).count(),
        pareto: false,
    }
}

fn compare(a: &str, b: &str, by: &BTreeMap<&str, Vec<&EvalResult>>, evaluation: &Evaluation) -> Comparison {
    let index = |s: &str| -> HashMap<(&str, u32), bool> {
        by.get(s)
            .map(|rows| rows.iter().map(|r| ((r.item_id.as_str(), r.repeat), r.correct)).collect())
            .unwrap_or_default()
    };
    let (ia, ib) = (index(a), index(b));
    let mut pairs = 0;
    let mut items: BTreeMap<&str, (f64, f64, u32)> = BTreeMap::new();
    for (key, &ra) in &ia {
        let Some(&rb) = ib.get(key) else { continue };
        pairs += 1;
        let e = items.entry(key.0).or_default();
        e.0 += f64::from(u8::from(ra));
        e.1 += f64::from(u8::from(rb));
        e.2 += 1;
    }
    let sa: Vec<f64> = items.values().map(|(x, _, n)| x / f64::from(*n)).collect();
    let sb: Vec<f64> = items.values().map(|(_, y, n)| y / f64::from(*n)).collect();
    // Repeats of one item are not independent pairs: McNemar counts items.
    let (only_a, only_b) = sa
        .iter()
        .zip(&sb)
        .fold((0, 0), |(a, b), (x, y)| (a + u64::from(*x >= 0.5 && *y < 0.5), b + u64::from(*y >= 0.5 && *x < 0.5)));
    let seed = evaluation.config["seed"].as_u64().unwrap_or(0);
    let boot = stats::paired_bootstrap(&sa, &sb, 10_000, seed);
    Comparison {
        a: a.to_owned(),
        b: b.to_owned(),
        pairs,
        only_a,
        only_b,
        mcnemar_p: stats::mcnemar_exact(only_a, only_b),
        difference: boot.difference,
        bootstrap_low: boot.low,
        bootstrap_high: boot.high,
        bootstrap_p: boot.p_value,
    }
}

fn usd(x: f64) -> String {
    if x == 0.0 {
        "$0".into()
    } else if x < 0.01 {
        format!("${x:.5}")
    } else {
        format!("${x:.4}")
    }
}

/// The terminal table.
pub fn table(report: &Report) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "evaluation {} on {} ({}), spent {}",
        report.id,
        report.suite,
        report.status,
        usd(report.spent_usd)
    );
    let header = [
        "strategy", "accuracy", "± se", "n", "calls", "in tok", "cached", "out tok", "$/item", "p50 ms", "p95 ms",
        "plans ok", "steps", "",
    ];
    let mut rows: Vec<Vec<String>> = vec![header.iter().map(|s| (*s).to_owned()).collect()];
    for s in &report.strategies {
        rows.push(vec![
            s.strategy.clone(),
            format!("{:.1}%", 100.0 * s.accuracy),
            format!("{:.1}", 100.0 * s.stderr),
            s.n.to_string(),
            s.figures.calls.to_string(),
            s.figures.usage.input_tokens.to_string(),
            s.figures.usage.cached_input_tokens.to_string(),
            s.figures.usage.output_tokens.to_string(),
            format!("{}{}", usd(s.cost_per_item_usd), if s.figures.cost_complete { "" } else { "+" }),
            s.latency_p50_ms.to_string(),
            s.latency_p95_ms.to_string(),
            s.plan_validity.map_or_else(String::new, |v| format!("{:.0}%", 100.0 * v)),
            s.mean_steps.map_or_else(String::new, |v| format!("{v:.1}")),
            if s.pareto { "front".into() } else { String::new() },
        ]);
    }
    let widths: Vec<usize> =
        (0..header.len()).map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0)).collect();
    for row in &rows {
        let line: Vec<String> = row
            .iter()
            .enumerate()
            .map(|(c, v)| if c == 0 { format!("{v:<w$}", w = widths[c]) } else { format!("{v:>w$}", w = widths[c]) })
            .collect();
        let _ = writeln!(out, "{}", line.join("  ").trim_end());
    }
    for c in &report.comparisons {
        let _ = writeln!(out, "{}", comparison_line(c));
    }
    let _ = writeln!(
        out,
        "Pareto front ({} per item): {}; AIQ {:.3}",
        if report.cost_axis == "usd" { "$" } else { "tokens" },
        report.pareto_front.join(", "),
        report.aiq
    );
    out
}

fn comparison_line(c: &Comparison) -> String {
    format!(
        "{} vs {}: {:+.1} points (95% CI {:+.1} to {:+.1}, bootstrap p = {:.3}); McNemar: {} right only by {}, {} only by {}, p = {:.3}; {} pairs",
        c.a,
        c.b,
        100.0 * c.difference,
        100.0 * c.bootstrap_low,
        100.0 * c.bootstrap_high,
        c.bootstrap_p,
        c.only_a,
        c.a,
        c.only_b,
        c.b,
        c.mcnemar_p,
        c.pairs
    )
}

/// The cost–accuracy chart (the command line's reports; the app draws its own).
pub fn svg(report: &Report) -> String {
    let (w, h, left, bottom, top, right) = (640.0, 400.0, 64.0, 48.0, 24.0, 160.0);
    let xs: Vec<f64> = report
        .strategies
        .iter()
        .map(|s| if report.cost_axis == "usd" { s.cost_per_item_usd } else { s.tokens_per_run() })
        .collect();
    let max_x = xs.iter().copied().fold(0.0, f64::max).max(1e-9) * 1.05;
    let px = |x: f64| left + (x / max_x) * (w - left - right);
    let py = |a: f64| top + (1.0 - a) * (h - top - bottom);
    let mut out = String::new();
    let _ = write!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} {h}" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = write!(out, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    for k in 0..=4 {
        let a = f64::from(k) / 4.0;
        let _ = write!(
            out,
            r##"<line x1="{left}" x2="{}" y1="{y}" y2="{y}" stroke="#ddd"/><text x="{}" y="{}" text-anchor="end">{:.0}%</text>"##,
            w - right,
            left - 6.0,
            py(a) + 4.0,
            100.0 * a,
            y = py(a)
        );
    }
    let _ = write!(
        out,
        r##"<line x1="{left}" x2="{}" y1="{y}" y2="{y}" stroke="#333"/><text x="{}" y="{}" text-anchor="middle">{}</text><text x="{}" y="{}" text-anchor="end">{}</text>"##,
        w - right,
        (left + w - right) / 2.0,
        h - 12.0,
        if report.cost_axis == "usd" { "cost per item (USD)" } else { "tokens per item" },
        w - right,
        h - bottom + 16.0,
        if report.cost_axis == "usd" { format!("{max_x:.4}") } else { format!("{max_x:.0}") },
        y = h - bottom
    );
    let front: Vec<(f64, f64)> = report
        .pareto_front
        .iter()
        .filter_map(|n| report.strategies.iter().position(|s| &s.strategy == n))
        .map(|i| (px(xs[i]), py(report.strategies[i].accuracy)))
        .collect();
    if front.len() > 1 {
        let pts: Vec<String> = front.iter().map(|(x, y)| format!("{x:.1},{y:.1}")).collect();
        let _ = write!(out, r##"<polyline points="{}" fill="none" stroke="#2a7" stroke-width="2"/>"##, pts.join(" "));
    }
    for (i, s) in report.strategies.iter().enumerate() {
        let (x, y) = (px(xs[i]), py(s.accuracy));
        let colour = if s.strategy == "conductor" {
            "#c33"
        } else if s.pareto {
            "#2a7"
        } else {
            "#467"
        };
        let _ = write!(
            out,
            r#"<circle cx="{x:.1}" cy="{y:.1}" r="5" fill="{colour}"><title>{} {:.1}%</title></circle><text x="{:.1}" y="{:.1}">{}</text>"#,
            escape(&s.strategy),
            100.0 * s.accuracy,
            x + 8.0,
            y + 4.0,
            escape(&s.strategy)
        );
    }
    out.push_str("</svg>\n");
    out
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// The Markdown report; `chart` is the SVG file's name beside it.
pub fn markdown(report: &Report, chart: &str) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "# Evaluation {}\n", report.id);
    let _ = writeln!(out, "Suite `{}`, status {}, spent {}.\n", report.suite, report.status, usd(report.spent_usd));
    let _ = writeln!(
        out,
        "| strategy | accuracy | ± se | n | calls | input tok | cached | output tok | $/item | p50 ms | p95 ms | plans ok | steps | front |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for s in &report.strategies {
        let _ = writeln!(
            out,
            "| {} | {:.1}% | {:.1} | {} | {} | {} | {} | {} | {}{} | {} | {} | {} | {} | {} |",
            s.strategy,
            100.0 * s.accuracy,
            100.0 * s.stderr,
            s.n,
            s.figures.calls,
            s.figures.usage.input_tokens,
            s.figures.usage.cached_input_tokens,
            s.figures.usage.output_tokens,
            usd(s.cost_per_item_usd),
            if s.figures.cost_complete { "" } else { "+" },
            s.latency_p50_ms,
            s.latency_p95_ms,
            s.plan_validity.map_or_else(String::new, |v| format!("{:.0}%", 100.0 * v)),
            s.mean_steps.map_or_else(String::new, |v| format!("{v:.1}")),
            if s.pareto { "yes" } else { "" }
        );
    }
    out.push('\n');
    for c in &report.comparisons {
        let _ = writeln!(out, "- {}", comparison_line(c));
    }
    let _ = writeln!(out, "\nAIQ (normalized area under the cost–accuracy front): {:.3}\n", report.aiq);
    let _ = writeln!(out, "![cost and accuracy]({chart})");
    out
}

/// A self-contained HTML report (the chart inline).
pub fn html(report: &Report) -> String {
    let md_table = markdown(report, "");
    let mut rows = String::new();
    for line in md_table.lines().filter(|l| l.starts_with("| ") && !l.starts_with("| strategy")) {
        let cells: Vec<String> =
            line.trim_matches('|').split('|').map(|c| format!("<td>{}</td>", escape(c.trim()))).collect();
        rows.push_str(&format!("<tr>{}</tr>\n", cells.join("")));
    }
    let comparisons: String =
        report.comparisons.iter().map(|c| format!("<li>{}</li>\n", escape(&comparison_line(c)))).collect();
    format!(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>Evaluation {id}</title>\
         <style>body{{font-family:sans-serif;margin:2em}}td,th{{padding:2px 8px;text-align:right}}td:first-child{{text-align:left}}</style></head>\
         <body><h1>Evaluation {id}</h1><p>Suite {suite}, status {status}, spent {spent}.</p>\
         <table><tr><th>strategy</th><th>accuracy</th><th>± se</th><th>n</th><th>calls</th><th>input tok</th><th>cached</th><th>output tok</th><th>$/item</th><th>p50 ms</th><th>p95 ms</th><th>plans ok</th><th>steps</th><th>front</th></tr>\n{rows}</table>\
         <ul>{comparisons}</ul><p>AIQ {aiq:.3}</p>{chart}</body></html>\n",
        id = escape(&report.id),
        suite = escape(&report.suite),
        status = escape(&report.status),
        spent = usd(report.spent_usd),
        aiq = report.aiq,
        chart = svg(report),
    )
}
