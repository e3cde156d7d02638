//! The conductor's prompt, from versioned files in `prompts/`: the task and the output format,
//! few-shot workflows from other kinds of tasks than the user's (the setting the paper found to
//! work best), and the workers as "Model 0 … Model k" with their descriptions.
//!
//! The order is for the local model's prefix cache: what never changes (task, format, examples)
//! comes first, then what changes with the pool (the workers), then what changes with the round
//! (the step cap, recursion), then the conversation and the question. Every question asked of
//! the same pool shares the whole system prompt, so only the question is prefilled; another
//! pool still shares everything up to its workers.

use baton_engine::{PlanningContext, WorkerInfo};
use baton_providers::{Message, Role};

/// The prompt version in use; recorded so a run can be traced to the words that produced it.
pub const PROMPT_VERSION: &str = "v2";

const SYSTEM: &str = include_str!("../prompts/v2/system.md");
const RECURSION: &str = include_str!("../prompts/v2/recursion.md");
const EXAMPLES: &str = include_str!("../prompts/v2/examples.md");

/// How many earlier conversation turns the conductor sees.
pub const HISTORY_TURNS: usize = 6;
/// Each earlier turn is cut to this many characters.
const HISTORY_CHARS: usize = 2000;

/// Builds the system prompt and the messages for one planning request.
#[derive(Debug, Clone)]
pub struct PromptBuilder {
    workers: Vec<WorkerInfo>,
    examples: bool,
}

impl PromptBuilder {
    pub fn new(workers: Vec<WorkerInfo>) -> Self {
        PromptBuilder { workers, examples: true }
    }

    /// Leaves out the few-shot workflows (for measuring what they are worth).
    pub fn without_examples(mut self) -> Self {
        self.examples = false;
        self
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
        let recursion = if ctx.allow_self {
            workers.push(format!(
                "- Model {}: yourself, the Conductor: sees the work its access list grants and writes a new workflow to continue or correct it",
                ctx.pool_size
            ));
            RECURSION.replace("{self_id}", &ctx.pool_size.to_string())
        } else {
            String::new()
        };
        // Filled in the order the parts appear, so a worker's description that happens to hold
        // a placeholder's name is left as it is.
        let (before_examples, rest) = SYSTEM.split_once("{examples}").expect("the system prompt has {examples}");
        let mut out = String::from(before_examples);
        out.push_str(if self.examples { EXAMPLES } else { "" });
        let (before_workers, rest) = rest.split_once("{workers}").expect("the system prompt has {workers}");
        out.push_str(before_workers);
        out.push_str(&workers.join("\n"));
        out.push_str(&rest.replace("{max_steps}", &ctx.max_steps.to_string()).replace("{recursion}", &recursion));
        out
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

    #[test]
    fn workers_are_numbered_and_anonymous() {
        let s = PromptBuilder::new(workers()).system(&ctx());
        assert!(s.contains(
            "- Model 0: good at task 0\n- Model 1: a general-purpose language model\n- Model 2: good at task 2"
        ));
        assert!(!s.contains("secret"), "names and model ids stay hidden");
        assert!(s.contains("at most 5 steps"));
        assert!(s.contains("Example 4."), "few-shot workflows are included");
        assert!(!s.contains("Model 3"), "the conductor is not offered outside recursion");
        assert!(!PromptBuilder::new(workers()).without_examples().system(&ctx()).contains("Example 1."));
    }

    #[test]
    fn every_example_is_a_valid_plan() {
        let limits = baton_plan::Limits { max_steps: 5, pool_size: Some(3), allow_stop: false };
        // "Example 1. …" to "Example 4. …"; the heading line also starts with "Example".
        let examples: Vec<&str> =
            EXAMPLES.split("\nExample ").filter(|e| e.starts_with(|c: char| c.is_ascii_digit())).collect();
        assert_eq!(examples.len(), 4);
        for example in examples {
            baton_plan::parse(example, &limits).unwrap_or_else(|e| panic!("{e}\n{example}"));
        }
    }

    #[test]
    fn what_changes_least_comes_first() {
        let p = PromptBuilder::new(workers());
        let question = p.system(&ctx());
        // Another question of the same pool: the whole system prompt is the same.
        assert_eq!(question, p.system(&PlanningContext::question("Something else entirely?", 3, 5)));
        // Another pool: everything up to its workers is the same, the examples included.
        let other = PromptBuilder::new(workers().into_iter().rev().collect()).system(&ctx());
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
