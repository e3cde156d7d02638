//! The conductor's prompt, from versioned files in `prompts/`: the task and the output format,
//! few-shot workflows, and the workers as "Model 0 … Model k" with their descriptions.
//!
//! Two versions:
//! - `v2` (the paper's setting): the conductor restates what each worker needs in its subtasks,
//!   may reason before the lists, and sees a fixed list of examples from other kinds of tasks.
//! - `v3` (the default, for small conductors): every worker is shown the question, so subtasks
//!   only say what a step does with it; no reasoning before the lists; and the examples are the
//!   three of a bank that fit the question best, the closest last.
//!
//! The order is for the local model's prefix cache: what never changes (task, format) comes
//! first, then what changes with the pool (the workers), then what changes with the round (the
//! step cap, recursion), then, in v3, the examples chosen for the question, then the
//! conversation and the question. Every question asked of the same pool shares the prompt up to
//! its examples (v2: the whole system prompt).

use baton_engine::learned::LearnedPlan;
use baton_engine::{PlanningContext, ShownExample, WorkerInfo};
use baton_providers::{Message, Role};

/// A version of the conductor's prompt; recorded with each plan so a run can be traced to the
/// words that produced it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PromptVersion {
    V2,
    #[default]
    V3,
}

impl PromptVersion {
    pub const NAMES: [&'static str; 2] = ["v2", "v3"];

    pub fn parse(name: &str) -> Option<PromptVersion> {
        match name {
            "v2" => Some(PromptVersion::V2),
            "v3" => Some(PromptVersion::V3),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            PromptVersion::V2 => "v2",
            PromptVersion::V3 => "v3",
        }
    }

    /// The reasoning a plan may start with, in characters, unless the pool sets it: v2 asks
    /// the conductor to think first; v3 asks for the lists alone.
    pub fn default_reasoning_chars(self) -> usize {
        match self {
            PromptVersion::V2 => 1200,
            PromptVersion::V3 => 0,
        }
    }

    fn files(self) -> (&'static str, &'static str, &'static str) {
        match self {
            PromptVersion::V2 => (V2_SYSTEM, V2_RECURSION, V2_EXAMPLES),
            PromptVersion::V3 => (V3_SYSTEM, V3_RECURSION, V3_EXAMPLES),
        }
    }
}

/// The prompt version in use by default.
pub const PROMPT_VERSION: &str = "v3";

const V2_SYSTEM: &str = include_str!("../prompts/v2/system.md");
const V2_RECURSION: &str = include_str!("../prompts/v2/recursion.md");
const V2_EXAMPLES: &str = include_str!("../prompts/v2/examples.md");
const V3_SYSTEM: &str = include_str!("../prompts/v3/system.md");
const V3_RECURSION: &str = include_str!("../prompts/v3/recursion.md");
const V3_EXAMPLES: &str = include_str!("../prompts/v3/examples.md");

/// How many of v3's bank of examples a prompt shows.
pub const V3_EXAMPLES_SHOWN: usize = 3;

/// How many earlier conversation turns the conductor sees.
pub const HISTORY_TURNS: usize = 6;
/// Each earlier turn is cut to this many characters.
const HISTORY_CHARS: usize = 2000;

/// Builds the system prompt and the messages for one planning request.
#[derive(Debug, Clone)]
pub struct PromptBuilder {
    workers: Vec<WorkerInfo>,
    examples: bool,
    version: PromptVersion,
    /// Plans that were right when the pool learned, cheapest first: v3's examples before the
    /// shipped bank's.
    learned: Vec<LearnedPlan>,
}

impl PromptBuilder {
    pub fn new(workers: Vec<WorkerInfo>) -> Self {
        PromptBuilder { workers, examples: true, version: PromptVersion::default(), learned: Vec::new() }
    }

    /// Shows `plans` (what was right when the pool learned) as v3's examples for the questions
    /// they fit, with their own workers: these examples say which worker did the work.
    pub fn with_learned(mut self, plans: Vec<LearnedPlan>) -> Self {
        self.learned = plans;
        self
    }

    pub fn with_version(mut self, version: PromptVersion) -> Self {
        self.version = version;
        self
    }

    pub fn version(&self) -> PromptVersion {
        self.version
    }

    /// Leaves out the few-shot workflows (for measuring what they are worth).
    pub fn without_examples(mut self) -> Self {
        self.examples = false;
        self
    }

    /// The example workflows a prompt for `ctx` shows, as text: none on a second attempt
    /// (the first may have copied one), v2's fixed list, or v3's closest to the question.
    pub fn examples_for(&self, ctx: &PlanningContext) -> String {
        self.choose_examples(ctx).text
    }

    /// The examples a prompt for `ctx` shows, with their questions and subtasks (what a plan
    /// is checked against for copies), taken from the examples themselves as they are chosen.
    pub fn shown_examples(&self, ctx: &PlanningContext) -> Vec<ShownExample> {
        self.choose_examples(ctx).examples
    }

    fn choose_examples(&self, ctx: &PlanningContext) -> Chosen {
        if !self.examples || ctx.attempt > 0 {
            return Chosen::default();
        }
        match self.version {
            PromptVersion::V2 => {
                let examples = V2_EXAMPLES
                    .split("\nExample ")
                    .filter_map(|e| {
                        let question = e.split_once("Question: ")?.1.split("\n```").next()?.lines().next()?;
                        shown(question, e)
                    })
                    .collect();
                Chosen { text: V2_EXAMPLES.to_owned(), examples }
            }
            PromptVersion::V3 => {
                let (intro, bank) = split_bank(V3_EXAMPLES);
                let learned = self.learned_bank(ctx);
                // A workflow longer than this round may be would teach a shape it cannot take.
                let fits = |e: &&Example<'_>| steps_in(e.text) <= ctx.max_steps;
                let bank: Vec<Example<'_>> =
                    learned.iter().map(Example::from).chain(bank).filter(|e| fits(&e)).collect();
                let closest = closest_examples(&bank, &ctx.question, V3_EXAMPLES_SHOWN);
                let intro = if closest.iter().any(|e| e.tag == LEARNED_TAG) { LEARNED_INTRO } else { intro };
                let mut chosen = Chosen { text: format!("\n{intro}"), examples: Vec::new() };
                for e in closest {
                    // The shipped bank's workers are illustrations: they are put on the lead. A
                    // learned plan keeps its own, which did the work.
                    let text = if e.tag == LEARNED_TAG {
                        e.text.to_owned()
                    } else {
                        with_models(e.text, ctx.lead.min(ctx.pool_size.saturating_sub(1)))
                    };
                    chosen.text.push_str(&format!("\n{text}\n"));
                    chosen.examples.extend(shown(e.question, e.text));
                }
                chosen
            }
        }
    }

    pub fn system(&self, ctx: &PlanningContext) -> String {
        let mut workers: Vec<String> = self
            .workers
            .iter()
            .take(ctx.pool_size)
            .enumerate()
            .map(|(i, w)| {
                let d = w
                    .description
                    .as_deref()
                    .filter(|d| !d.trim().is_empty())
                    .unwrap_or("a general-purpose language model");
                format!("- Model {i}: {d}")
            })
            .collect();
        let (system, recursion, _) = self.version.files();
        let recursion = if ctx.allow_self {
            workers.push(format!(
                "- Model {}: yourself, the Conductor: sees the work its access list grants and writes a new workflow to continue or correct it",
                ctx.pool_size
            ));
            recursion.replace("{self_id}", &ctx.pool_size.to_string())
        } else {
            String::new()
        };
        // Filled in the order the parts appear, so a worker's description or an example that
        // happens to hold a placeholder's name is left as it is.
        let fill =
            |part: &str| part.replace("{max_steps}", &ctx.max_steps.to_string()).replace("{recursion}", &recursion);
        let mut out = String::new();
        let mut rest = system;
        while let Some(at) = rest.find('{') {
            let (before, from) = rest.split_at(at);
            out.push_str(&fill(before));
            if let Some(after) = from.strip_prefix("{examples}") {
                out.push_str(&self.examples_for(ctx));
                rest = after;
            } else if let Some(after) = from.strip_prefix("{workers}") {
                out.push_str(&workers.join("\n"));
                rest = after;
            } else {
                // `{max_steps}` and `{recursion}` are filled with the text around them.
                let end = from.find('}').map_or(from.len(), |e| e + 1);
                out.push_str(&fill(&from[..end]));
                rest = &from[end..];
            }
        }
        out.push_str(&fill(rest));
        out
    }

    /// The request as recorded with its plan.
    pub fn record(&self, system: &str, messages: &[Message]) -> baton_engine::PlanPrompt {
        baton_engine::PlanPrompt {
            version: self.version.as_str().to_owned(),
            system: system.to_owned(),
            messages: messages.to_vec(),
        }
    }

    /// The conversation so far (bounded), then the question, and for a recursive round the
    /// work handed back.
    pub fn messages(&self, ctx: &PlanningContext) -> Vec<Message> {
        let mut out: Vec<Message> = ctx
            .history
            .iter()
            .rev()
            .take(HISTORY_TURNS)
            .rev()
            .map(|m| Message { role: m.role, content: truncate(&m.content, HISTORY_CHARS) })
            .collect();
        // A history must start with the user and alternate; drop a leading assistant turn.
        if out.first().is_some_and(|m| m.role == Role::Assistant) {
            out.remove(0);
        }
        let mut question = format!("Question: {}", ctx.question);
        if let Some(instructions) = &ctx.instructions {
            question.push_str(&format!("\n\nThe user's instructions for the answer: {instructions}"));
        }
        if ctx.allow_stop {
            question.push_str("\n\nThe work so far:\n");
            let (instruction, pairs) = match ctx.work.split_last() {
                Some((last, rest)) if last.role == Role::User => (Some(last.content.as_str()), rest),
                _ => (None, ctx.work.as_slice()),
            };
            if pairs.is_empty() {
                question.push_str("\n(none yet)\n");
            }
            for pair in pairs.chunks(2) {
                if let [task, answer] = pair {
                    question.push_str(&format!("\nStep: {}\nAnswer: {}\n", task.content, answer.content));
                }
            }
            if let Some(instruction) = instruction {
                question.push_str(&format!("\nYour instruction: {instruction}\n"));
            }
            question.push_str(
                "\nWrite a workflow that continues or corrects this work. If the work is already correct and complete, write three empty lists to stop.",
            );
        }
        out.push(Message::user(question));
        out
    }
}

/// How a learned plan is tagged among the examples. Its kind is its question's; of a learned
/// and a shipped example that fit equally, the learned one is chosen.
const LEARNED_TAG: &str = "learned";

/// The examples' introduction once the pool has learned plans: their workers are real.
const LEARNED_INTRO: &str = "Example workflows for other questions. Those marked [learned] answered right in this pool,\n\
on the models they name; the others are illustrations only (use the models listed above):";

/// A learned plan as an example of the bank's form.
struct LearnedExample {
    question: String,
    text: String,
}

impl<'a> From<&'a LearnedExample> for Example<'a> {
    fn from(e: &'a LearnedExample) -> Self {
        Example { tag: LEARNED_TAG, question: &e.question, text: &e.text }
    }
}

impl PromptBuilder {
    /// The learned plans that fit this round (its workers, no more steps than it may take),
    /// cheapest first, as examples.
    fn learned_bank(&self, ctx: &PlanningContext) -> Vec<LearnedExample> {
        self.learned
            .iter()
            .filter(|p| p.plan.steps.iter().all(|s| s.model_id < ctx.pool_size) && p.plan.steps.len() <= ctx.max_steps)
            .map(|p| LearnedExample {
                // Its lines kept: lettered options on lines of their own tell its kind.
                question: truncate(&p.question, 300),
                text: format!(
                    "Example [{LEARNED_TAG}]. Question: {}\n```python\n{}\n```",
                    truncate(&p.question.replace('\n', " "), 300),
                    p.plan.to_python().trim_end()
                ),
            })
            .collect()
    }
}

/// The examples one prompt shows: its text, and the same examples as data.
#[derive(Debug, Default)]
struct Chosen {
    text: String,
    examples: Vec<ShownExample>,
}

/// An example's question and the subtasks of its workflow (`text`).
fn shown(question: &str, text: &str) -> Option<ShownExample> {
    let limits = baton_plan::Limits { max_steps: 64, pool_size: None, allow_stop: false };
    let plan = baton_plan::parse(text, &limits).ok()?;
    Some(ShownExample { question: question.to_owned(), subtasks: plan.steps.into_iter().map(|s| s.subtask).collect() })
}

/// One workflow of v3's example bank.
#[derive(Debug, Clone)]
struct Example<'a> {
    /// The kind of question it shows: `fact`, `math`, `choice`, `hard`, `code`, `writing`.
    tag: &'a str,
    question: &'a str,
    text: &'a str,
}

/// How many steps an example's workflow has (its `model_id` list's length).
fn steps_in(text: &str) -> usize {
    text.lines()
        .find_map(|line| line.strip_prefix("model_id = ["))
        .map_or(0, |rest| rest.trim_end_matches(']').split(',').filter(|n| !n.trim().is_empty()).count())
}

/// An example with every step on Model `lead`. A small conductor copies an example's model
/// numbers with its shape; written for the pool's strongest worker, the copy is harmless.
fn with_models(text: &str, lead: usize) -> String {
    text.lines()
        .map(|line| match line.strip_prefix("model_id = [") {
            Some(rest) => {
                let steps = rest.trim_end_matches(']').split(',').count();
                format!("model_id = [{}]", vec![lead.to_string(); steps].join(", "))
            }
            None => line.to_owned(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The bank's introduction and its examples (`Example [tag]. Question: …` to the fence).
fn split_bank(bank: &str) -> (&str, Vec<Example<'_>>) {
    const HEAD: &str = "\nExample [";
    let starts: Vec<usize> = bank.match_indices(HEAD).map(|(i, _)| i + 1).collect();
    let intro = &bank[..starts.first().map_or(bank.len(), |s| s - 1)];
    let examples = starts
        .iter()
        .enumerate()
        .filter_map(|(k, &from)| {
            let to = starts.get(k + 1).map_or(bank.len(), |next| next - 1);
            let text = bank[from..to].trim_end();
            let (tag, rest) = text.strip_prefix("Example [")?.split_once("]. Question: ")?;
            let question = rest.lines().next().unwrap_or_default();
            Some(Example { tag, question, text })
        })
        .collect();
    (intro.trim_end(), examples)
}

/// What kind of question this looks like, for choosing examples (cheap signs only: lettered
/// options, told as routing by kind tells them; code words; digits).
fn question_tags(question: &str) -> Vec<&'static str> {
    let lower = question.to_lowercase();
    let mut tags = Vec::new();
    let lettered = baton_engine::routing::has_lettered_options(question);
    if lettered {
        tags.push("choice");
    }
    if ["python", "function", "def ", "code", "program", "return "].iter().any(|w| lower.contains(w)) {
        tags.push("code");
    }
    if !lettered && lower.chars().any(|c| c.is_ascii_digit()) {
        tags.push("math");
    }
    if ["write a", "poem", "story", "essay", "haiku"].iter().any(|w| lower.contains(w)) {
        tags.push("writing");
    }
    tags
}

/// Content words (lower case, three letters or more).
fn content_words(text: &str) -> std::collections::HashSet<String> {
    text.split(|c: char| !c.is_alphanumeric()).filter(|w| w.len() >= 3).map(str::to_lowercase).collect()
}

/// The `n` examples that fit `question` best, the best last (a small model leans on what it
/// read last). A matching kind counts most, then shared words; ties keep the bank's order.
fn closest_examples<'a>(bank: &[Example<'a>], question: &str, n: usize) -> Vec<Example<'a>> {
    let tags = question_tags(question);
    let words = content_words(question);
    let mut scored: Vec<(f64, usize, &Example<'a>)> = bank
        .iter()
        .enumerate()
        .map(|(i, e)| {
            // A learned plan's kind is its question's.
            let same_kind = if e.tag == LEARNED_TAG {
                question_tags(e.question).iter().any(|t| tags.contains(t))
            } else {
                tags.contains(&e.tag)
            };
            let kind = if same_kind { 10.0 } else { 0.0 };
            let theirs = content_words(e.question);
            let shared = words.intersection(&theirs).count() as f64 / (theirs.len().max(1) as f64).sqrt();
            (kind + shared, i, e)
        })
        .collect();
    // Best first, bank order among equals; then the best goes last.
    scored.sort_by(|a, b| b.0.partial_cmp(&a.0).unwrap_or(std::cmp::Ordering::Equal).then(a.1.cmp(&b.1)));
    let mut chosen: Vec<Example<'a>> = scored.into_iter().take(n).map(|(_, _, e)| e.clone()).collect();
    chosen.reverse();
    chosen
}

fn truncate(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        return text.to_owned();
    }
    let mut out: String = text.chars().take(max).collect();
    out.push('…');
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_providers::ProviderKind;

    fn workers() -> Vec<WorkerInfo> {
        (0..3)
            .map(|i| WorkerInfo {
                index: i,
                name: format!("secret-name-{i}"),
                provider: ProviderKind::OpenAi,
                model: format!("secret-model-{i}"),
                description: (i != 1).then(|| format!("good at task {i}")),
            })
            .collect()
    }

    fn ctx() -> PlanningContext {
        PlanningContext::question("Why is the sky blue?", 3, 5)
    }

    fn v2(workers: Vec<WorkerInfo>) -> PromptBuilder {
        PromptBuilder::new(workers).with_version(PromptVersion::V2)
    }

    #[test]
    fn workers_are_numbered_and_anonymous() {
        let s = v2(workers()).system(&ctx());
        assert!(s.contains(
            "- Model 0: good at task 0\n- Model 1: a general-purpose language model\n- Model 2: good at task 2"
        ));
        assert!(!s.contains("secret"), "names and model ids stay hidden");
        assert!(s.contains("at most 5 steps"));
        assert!(s.contains("Example 4."), "few-shot workflows are included");
        assert!(!s.contains("Model 3"), "the conductor is not offered outside recursion");
        assert!(!v2(workers()).without_examples().system(&ctx()).contains("Example 1."));
        let v3 = PromptBuilder::new(workers()).system(&ctx());
        assert!(v3.contains("- Model 0: good at task 0\n- Model 1: a general-purpose language model"));
        assert!(!v3.contains("secret") && !v3.contains('{'), "{v3}");
    }

    #[test]
    fn every_example_is_a_valid_plan() {
        let limits = baton_plan::Limits { max_steps: 5, pool_size: Some(3), allow_stop: false };
        // "Example 1. …" to "Example 4. …"; the heading line also starts with "Example".
        let examples: Vec<&str> =
            V2_EXAMPLES.split("\nExample ").filter(|e| e.starts_with(|c: char| c.is_ascii_digit())).collect();
        assert_eq!(examples.len(), 4);
        for example in examples {
            baton_plan::parse(example, &limits).unwrap_or_else(|e| panic!("{e}\n{example}"));
        }
        let (intro, bank) = split_bank(V3_EXAMPLES);
        assert!(intro.starts_with("Example workflows"), "{intro}");
        assert_eq!(bank.len(), 8);
        for example in &bank {
            let plan = baton_plan::parse(example.text, &limits).unwrap_or_else(|e| panic!("{e}\n{}", example.text));
            // Every subtask is shorter than a copy's run of words: the examples teach short
            // subtasks, and adapting one to the question ("Factor 196; …") is not a copy.
            for step in &plan.steps {
                let words = step.subtask.split(|c: char| !c.is_alphanumeric()).filter(|w| !w.is_empty()).count();
                assert!(words < baton_engine::plan_check::COPY_WORDS, "{words} words: {}", step.subtask);
            }
        }
    }

    fn learned(question: &str, workers: &[usize], cost_usd: f64) -> LearnedPlan {
        let steps = workers
            .iter()
            .map(|&w| baton_plan::Step {
                model_id: w,
                subtask: "Answer the question.".into(),
                access: baton_plan::Access::Steps(Vec::new()),
            })
            .collect();
        LearnedPlan {
            question: question.into(),
            category: "c".into(),
            plan: baton_plan::Plan { steps },
            cost_usd,
            calls: workers.len() as u64,
        }
    }

    #[test]
    fn learned_plans_are_shown_on_their_own_workers_before_the_shipped_examples_and_the_cheaper_first() {
        let choice = PlanningContext::question(
            "Which river is longest?\n\nA. Nile\nB. Amazon\nC. Yangtze\nD. Volga\n\nChoose one option.",
            3,
            5,
        );
        let plans = vec![
            // Cheapest first, as the history gives them.
            learned("Which river flows through Cairo?\n\nA. Nile\nB. Seine\nC. Po\nD. Ebro", &[2], 0.001),
            learned("Which river flows through Paris?\n\nA. Nile\nB. Seine\nC. Po\nD. Ebro", &[1], 0.01),
            // A plan on a worker this round does not have is never shown.
            learned("Which river flows through Rome?\n\nA. Nile\nB. Seine\nC. Tiber\nD. Ebro", &[7], 0.0),
        ];
        let mut ctx = choice.clone();
        ctx.lead = 0;
        let p = PromptBuilder::new(workers()).with_learned(plans);
        let shown = p.examples_for(&ctx);
        assert!(shown.contains("marked [learned] answered right in this pool"), "{shown}");
        let last = shown.rsplit("\nExample [").next().unwrap_or_default();
        assert!(last.starts_with("learned]. Question: Which river flows through Cairo?"), "{shown}");
        assert!(last.contains("model_id = [2]"), "a learned plan keeps its worker: {last}");
        assert!(shown.contains("Paris") && !shown.contains("Rome"), "{shown}");
        assert_eq!(p.shown_examples(&ctx).len(), V3_EXAMPLES_SHOWN, "learned examples are checked for copies too");
        // Nothing learned: the shipped bank, on the lead.
        let shipped = PromptBuilder::new(workers()).examples_for(&ctx);
        assert!(!shipped.contains("[learned]") && !shipped.contains("model_id = [2]"), "{shipped}");
    }

    #[test]
    fn v3_shows_the_examples_closest_to_the_question_the_closest_last() {
        let p = PromptBuilder::new(workers());
        let choice = PlanningContext::question(
            "Which planet is largest?\n\nA. Mars\nB. Jupiter\nC. Venus\nD. Earth\n\nChoose one option.",
            3,
            5,
        );
        let shown = p.examples_for(&choice);
        assert_eq!(shown.matches("\nExample [").count(), V3_EXAMPLES_SHOWN, "{shown}");
        let last = shown.rsplit("\nExample [").next().unwrap_or_default();
        assert!(last.starts_with("choice]"), "{shown}");
        let code = PlanningContext::question("Write a Python function that reverses a list.", 3, 5);
        let last = p.examples_for(&code).rsplit("\nExample [").next().unwrap_or_default().to_owned();
        assert!(last.starts_with("code]"), "{last}");
        let math = PlanningContext::question("How many positive divisors does 196 have?", 3, 5);
        let last = p.examples_for(&math).rsplit("\nExample [").next().unwrap_or_default().to_owned();
        assert!(last.starts_with("math]") && last.contains("divisors"), "{last}");
        // The examples shown are the ones whose subtasks a copy is checked against.
        let shown = p.shown_examples(&math);
        assert_eq!(shown.len(), V3_EXAMPLES_SHOWN);
        assert!(shown.iter().any(|e| e.question.contains("360") && e.subtasks[0].contains("360")), "{shown:?}");
        // Every example step is on the lead worker, whatever model the bank wrote.
        let hard = PlanningContext::question("Which is larger, 2^100 or 3^63? Explain.", 3, 5);
        let text = p.examples_for(&PlanningContext { lead: 2, ..hard.clone() });
        assert!(text.contains("model_id = [2, 2, 2]") && !text.contains("model_id = [0"), "{text}");
        assert!(p.examples_for(&hard).contains("model_id = [0, 0, 0]"));
        let beyond = p.examples_for(&PlanningContext { lead: 7, ..hard });
        assert!(beyond.contains("model_id = [2, 2, 2]"), "a lead outside the pool is its last worker");
        // A round capped at fewer steps is shown only workflows it may write.
        let one = PlanningContext::question("Which is larger, 2^100 or 3^63? Explain.", 3, 1);
        let text = p.examples_for(&one);
        assert!(text.contains("\nExample [") && !text.contains(", 0]"), "{text}");
        // A second attempt shows none, so it cannot copy one.
        let again = PlanningContext { attempt: 1, ..math };
        assert_eq!(p.examples_for(&again), "");
        assert!(p.shown_examples(&again).is_empty());
        assert_eq!(v2(workers()).shown_examples(&ctx()).len(), 4);
        assert!(!p.system(&again).contains("Example ["));
    }

    #[test]
    fn what_changes_least_comes_first() {
        let v3 = PromptBuilder::new(workers());
        let a = v3.system(&ctx());
        let b = v3.system(&PlanningContext::question("Write a Python function that sorts.", 3, 5));
        let shared = a.chars().zip(b.chars()).take_while(|(x, y)| x == y).count();
        assert!(shared >= a.find("Example workflows").expect("examples"), "v3 shares all but its examples");
        assert!(a.find("- Model 0").expect("workers") < a.find("Example workflows").expect("examples"));
        let p = v2(workers());
        let question = p.system(&ctx());
        // Another question of the same pool: the whole system prompt is the same.
        assert_eq!(question, p.system(&PlanningContext::question("Something else entirely?", 3, 5)));
        // Another pool: everything up to its workers is the same, the examples included.
        let other = v2(workers().into_iter().rev().collect()).system(&ctx());
        let shared = question.chars().zip(other.chars()).take_while(|(a, b)| a == b).count();
        let workers_at = question.find("- Model 0").expect("workers listed");
        // (They may share a little more: the two worker lists can start alike.)
        assert!(shared >= workers_at, "the prompts part before the workers: {shared} < {workers_at}");
        assert!(question[..workers_at].contains("Example 4."));
        // A recursive round: everything up to the round's own lines is the same.
        let round = PlanningContext { allow_self: true, allow_stop: true, depth: 1, max_steps: 2, ..ctx() };
        let recursive = p.system(&round);
        let shared = question.chars().zip(recursive.chars()).take_while(|(a, b)| a == b).count();
        assert!(shared >= question.find("\n\nA workflow has at most").expect("step cap"), "{shared}");
    }

    #[test]
    fn recursion_offers_the_conductor_and_shows_the_work() {
        let c = PlanningContext {
            allow_self: true,
            allow_stop: true,
            depth: 1,
            work: vec![Message::user("Solve it."), Message::assistant("42"), Message::user("Verify and fix.")],
            ..ctx()
        };
        let p = PromptBuilder::new(workers());
        assert!(p.system(&c).contains("- Model 3: yourself"));
        assert!(v2(workers()).system(&c).contains("- Model 3: yourself"));
        let m = p.messages(&c);
        let last = &m.last().expect("a message").content;
        assert!(last.contains("Step: Solve it.\nAnswer: 42"), "{last}");
        assert!(last.contains("Your instruction: Verify and fix."), "{last}");
        assert!(last.contains("three empty lists"));
    }

    #[test]
    fn history_is_bounded_and_starts_with_the_user() {
        let history: Vec<Message> = (0..9)
            .map(|i| if i % 2 == 0 { Message::user(format!("q{i}")) } else { Message::assistant("a".repeat(5000)) })
            .collect();
        let m = PromptBuilder::new(workers()).messages(&PlanningContext { history, ..ctx() });
        assert!(m.len() <= HISTORY_TURNS + 1);
        assert_eq!(m[0].role, Role::User);
        assert!(m.iter().all(|x| x.content.chars().count() <= HISTORY_CHARS + 1));
    }
}
