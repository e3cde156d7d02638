//! The plan check against a real conductor's plans, labelled by a person.
//!
//! `tests/data/first-plans-qwen-1.5b.jsonl` holds the first plan Qwen2.5-Coder-1.5B-Instruct
//! (Q4_K_M, prompt v3) wrote for each held-out and dev item of the conductor-quality yardstick
//! (60 + 40, MATH500 and MMLU), the examples its prompt showed, and a label: is the plan about
//! the question (`about_question`), and if not, why. `scripts/first-plans` records the plans
//! again, keeping the labels.
//!
//! Every plan the check rejects costs a second conductor call and may end in a needless
//! fallback, so the check must rarely reject a plan that is about the question.

use std::collections::BTreeMap;

use baton_engine::ShownExample;
use baton_engine::plan_check::check;
use baton_plan::{Access, Plan, Step};

#[derive(serde::Deserialize)]
struct Labelled {
    item: String,
    question: String,
    subtasks: Vec<String>,
    examples: Vec<Example>,
    about_question: Option<bool>,
    why: Option<String>,
}

#[derive(serde::Deserialize)]
struct Example {
    question: String,
    subtasks: Vec<String>,
}

fn plans() -> Vec<Labelled> {
    let text = include_str!("data/first-plans-qwen-1.5b.jsonl");
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

/// The highest share of plans about the question that the check may reject.
const MAX_FALSE_REJECTIONS: f64 = 0.05;

#[test]
fn the_plan_check_rarely_rejects_a_plan_about_the_question() {
    let plans = plans();
    assert!(plans.len() >= 90, "a sample too small to measure a 5% rate: {}", plans.len());
    let mut verdicts: BTreeMap<(bool, bool), Vec<String>> = BTreeMap::new();
    for p in &plans {
        let about = p.about_question.unwrap_or_else(|| panic!("{}: not labelled", p.item));
        if !about {
            assert!(
                p.why.as_deref().is_some_and(|w| !w.is_empty()),
                "{}: say why it is not about the question",
                p.item
            );
        }
        let plan = Plan {
            steps: p.subtasks.iter().map(|s| Step { model_id: 0, subtask: s.clone(), access: Access::All }).collect(),
        };
        let shown: Vec<ShownExample> = p
            .examples
            .iter()
            .map(|e| ShownExample { question: e.question.clone(), subtasks: e.subtasks.clone() })
            .collect();
        // Prompt v3 always shows the workers the question.
        let verdict = check(&plan, &shown, &p.question, true);
        let line =
            format!("{}: {:?} -> {}", p.item, p.subtasks, verdict.as_ref().map_or("kept".into(), ToString::to_string));
        verdicts.entry((about, verdict.is_some())).or_default().push(line);
    }
    let count = |about, rejected| verdicts.get(&(about, rejected)).map_or(0, Vec::len);
    let (about, falsely) = (count(true, false) + count(true, true), count(true, true));
    let (not_about, caught) = (count(false, false) + count(false, true), count(false, true));
    let rate = falsely as f64 / about.max(1) as f64;
    let report = format!(
        "{falsely} of {about} plans about the question rejected ({:.1}%); {caught} of {not_about} plans not about it caught\nfalse rejections:\n{}\nmissed:\n{}",
        rate * 100.0,
        verdicts.get(&(true, true)).map(|v| v.join("\n")).unwrap_or_default(),
        verdicts.get(&(false, false)).map(|v| v.join("\n")).unwrap_or_default()
    );
    eprintln!("{report}");
    assert!(about >= 40, "too few plans about the question to measure: {report}");
    assert!(rate < MAX_FALSE_REJECTIONS, "{report}");
    // Every plan labelled as not about its question copies an example; the check must keep
    // catching those.
    assert_eq!(caught, not_about, "{report}");
}
