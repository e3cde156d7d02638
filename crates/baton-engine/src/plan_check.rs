//! When a conductor's plan is not a plan for the question.
//!
//! A small conductor often writes a plan that parses but cannot answer: it repeats one of the
//! prompt's example workflows (a Fibonacci review for a word problem), or its subtasks describe
//! the question without its numbers while the workers never see the question itself, or its
//! subtasks loop (the same phrase over and over until the token limit). Such a plan is asked
//! for once more, differently; if that one is no better, the question goes to one worker alone
//! ([`crate::fallback`]). The run says that it fell back and why.

use std::collections::{HashMap, HashSet};

use baton_plan::Plan;

use crate::planner::ShownExample;
use crate::words::{COMMON, words};

/// A copy is a run of this many words, in order, shared with an example's subtask.
pub const COPY_WORDS: usize = 8;

/// A subtask loops when a run of this many words comes back [`LOOP_TIMES`] times in it.
pub const LOOP_WORDS: usize = 6;
pub const LOOP_TIMES: usize = 3;

/// Why a plan cannot be run as it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unusable {
    /// Step `step`'s subtask says the same words over and over: a model caught in a loop, not
    /// an instruction (and a long one, that costs every call that reads it).
    RepeatsItself { step: usize, words: String },
    /// Step `step`'s subtask repeats an example workflow's words.
    CopiesExample { step: usize, words: String },
    /// Step `step`'s subtask names what only an example's question has (its numbers, its
    /// subject): it is about that question, not the user's.
    AboutAnExample { step: usize, term: String },
    /// No worker would see the whole question: no subtask holds it, and the pool neither shows
    /// it to the workers (`show_question`) nor gives it to the answer step
    /// (`question_to_answer_step`).
    QuestionNotGiven,
}

impl std::fmt::Display for Unusable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unusable::RepeatsItself { step, words } => {
                write!(f, "step {step} repeats itself (\"{words}\" over and over)")
            }
            Unusable::CopiesExample { step, words } => {
                write!(f, "step {step} copies an example workflow (\"{words}\")")
            }
            Unusable::AboutAnExample { step, term } => {
                write!(f, "step {step} is about an example's question, not this one (\"{term}\")")
            }
            Unusable::QuestionNotGiven => f.write_str("no step gives the workers the question"),
        }
    }
}

/// Checks a plan for the question: loops first, then copies of an example, since a copied plan
/// is about another question whatever it shows its workers.
pub fn check(plan: &Plan, examples: &[ShownExample], question: &str, pool_gives_it: bool) -> Option<Unusable> {
    let unusable = repeats_itself(plan, question)
        .or_else(|| copied_example(plan, examples))
        .or_else(|| about_an_example(plan, examples, question));
    if unusable.is_some() {
        return unusable;
    }
    if !pool_gives_it && !plan.steps.iter().any(|s| holds_question(&s.subtask, question)) {
        return Some(Unusable::QuestionNotGiven);
    }
    None
}

/// The first step whose subtask holds a run of [`LOOP_WORDS`] words [`LOOP_TIMES`] times. Runs
/// the question itself holds do not count: a subtask may quote a question that repeats itself
/// (a matrix, a list of equal numbers).
pub fn repeats_itself(plan: &Plan, question: &str) -> Option<Unusable> {
    let q = words(question);
    let quoted: HashSet<&[String]> = q.windows(LOOP_WORDS).collect();
    for (i, step) in plan.steps.iter().enumerate() {
        let w = words(&step.subtask);
        let mut seen: HashMap<&[String], usize> = HashMap::new();
        for run in w.windows(LOOP_WORDS).filter(|run| !quoted.contains(run)) {
            let times = seen.entry(run).or_default();
            *times += 1;
            if *times == LOOP_TIMES {
                return Some(Unusable::RepeatsItself { step: i, words: run.join(" ") });
            }
        }
    }
    None
}

/// The first step whose subtask shares a run of [`COPY_WORDS`] words with an example's.
pub fn copied_example(plan: &Plan, examples: &[ShownExample]) -> Option<Unusable> {
    let runs: HashSet<Vec<String>> = examples
        .iter()
        .flat_map(|e| &e.subtasks)
        .flat_map(|t| {
            let w = words(t);
            w.windows(COPY_WORDS).map(<[String]>::to_vec).collect::<Vec<_>>()
        })
        .collect();
    for (i, step) in plan.steps.iter().enumerate() {
        let w = words(&step.subtask);
        if let Some(run) = w.windows(COPY_WORDS).find(|run| runs.contains(*run)) {
            return Some(Unusable::CopiesExample { step: i, words: run.join(" ") });
        }
    }
    None
}

/// The first step whose subtask names a term that only a shown example's question has: a word
/// of it (three letters or more, or a number of two digits or more) that is neither in the
/// user's question nor common.
pub fn about_an_example(plan: &Plan, examples: &[ShownExample], question: &str) -> Option<Unusable> {
    let theirs: HashSet<String> = words(question).into_iter().collect();
    let distinctive = |w: &String| {
        let number = w.chars().all(|c| c.is_ascii_digit());
        (if number { w.len() >= 2 } else { w.chars().count() >= 3 })
            && !theirs.contains(w)
            && !COMMON.contains(&w.as_str())
    };
    let terms: HashSet<String> = examples.iter().flat_map(|e| words(&e.question)).filter(distinctive).collect();
    for (i, step) in plan.steps.iter().enumerate() {
        if let Some(term) = words(&step.subtask).into_iter().find(|w| terms.contains(w)) {
            return Some(Unusable::AboutAnExample { step: i, term });
        }
    }
    None
}

/// Whether `subtask` carries the whole question: every word of it, in order (punctuation,
/// case and spacing aside), so a conductor may quote it inside an instruction.
pub fn holds_question(subtask: &str, question: &str) -> bool {
    let q = words(question);
    if q.is_empty() {
        return true;
    }
    let s = words(subtask);
    s.windows(q.len()).any(|w| w == q.as_slice())
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_plan::{Access, Step};

    fn plan(subtasks: &[&str]) -> Plan {
        Plan {
            steps: subtasks
                .iter()
                .map(|s| Step { model_id: 0, subtask: (*s).to_owned(), access: Access::Steps(vec![]) })
                .collect(),
        }
    }

    const EXAMPLE: &str = "Review the function above: trace it by hand for n = 0, 1, 2, 10 and 50, and list every bug.";

    fn shown(question: &str, subtasks: &[&str]) -> Vec<ShownExample> {
        vec![ShownExample { question: question.into(), subtasks: subtasks.iter().map(|s| (*s).to_owned()).collect() }]
    }

    #[test]
    fn a_subtask_that_says_the_same_words_over_and_over_loops() {
        // What a small conductor wrote for a word problem, its text cut short here.
        let looping = plan(&[
            "Solve the problem.",
            "The answer is: 120.  The answer is: 120.  The answer is: 120.  The answer is: 120.  The answer 1",
        ]);
        assert_eq!(
            check(&looping, &[], "A train travels 120 km in 1.5 hours. What is its speed?", true),
            Some(Unusable::RepeatsItself { step: 1, words: "the answer is 120 the answer".into() })
        );
        // Twice is not a loop, nor is a long instruction whose words come back apart.
        let twice = plan(&["Check that the answer is right; then check that the answer is right for n = 0."]);
        assert_eq!(repeats_itself(&twice, "Is it right?"), None);
        let long = plan(&[
            "Compute the speed from the distance and the time, check the units of the speed, and give the speed in km/h with the distance and the time shown.",
        ]);
        assert_eq!(repeats_itself(&long, "How fast?"), None);
        // A question that repeats itself may be quoted whole.
        let matrix = "Invert [[1,0,0,0],[0,1,0,0],[0,0,1,0],[0,0,0,1]].";
        assert_eq!(check(&plan(&[&format!("Solve: {matrix} Show each step.")]), &[], matrix, false), None);
        let sevens = "What is the mode of 7, 7, 7, 7, 7, 7, 7, 7?";
        assert_eq!(repeats_itself(&plan(&[sevens]), sevens), None);
    }

    #[test]
    fn eight_shared_words_in_order_are_a_copy() {
        let examples = shown("Write fib(n).", &[EXAMPLE]);
        let copied = plan(&["Solve it.", "review the function ABOVE -- trace it by hand for n=0, 1, 2"]);
        assert_eq!(
            copied_example(&copied, &examples),
            Some(Unusable::CopiesExample { step: 1, words: "review the function above trace it by hand".into() })
        );
        // Seven words in a row are not a copy; neither are the same words out of order.
        let near = plan(&["Review the function above: trace it by", "by hand it trace above function the review"]);
        assert_eq!(copied_example(&near, &examples), None);
    }

    #[test]
    fn the_question_reaches_the_workers_in_a_subtask_or_by_the_pool() {
        let question = "Tom has 3 apples and buys 4 more. How many apples does he have?";
        let quoted = plan(&["Solve this: tom has 3 apples and buys 4 more; how many apples does he have? Show work."]);
        assert_eq!(check(&quoted, &[], question, false), None);
        let vague = plan(&["Count the apples Tom has after buying more."]);
        assert_eq!(check(&vague, &[], question, false), Some(Unusable::QuestionNotGiven));
        assert_eq!(check(&vague, &[], question, true), None, "show_question gives it to every worker");
        // A copy is unusable even when the workers see the question.
        let copy = plan(&[EXAMPLE]);
        assert!(matches!(
            check(&copy, &shown("Fib?", &[EXAMPLE]), question, true),
            Some(Unusable::CopiesExample { .. })
        ));
    }

    #[test]
    fn a_subtask_naming_what_only_an_example_has_is_about_that_example() {
        let examples = shown("How many positive divisors does 360 have?", &["Factor 360; count its divisors."]);
        let question = "How many positive whole-number divisors does 196 have?";
        // Adapted to the question: fine, though it shares words with the example.
        assert_eq!(check(&plan(&["Factor 196 into primes; count its divisors."]), &examples, question, true), None);
        assert_eq!(
            check(&plan(&["Solve it.", "Factor 360 into primes."]), &examples, question, true),
            Some(Unusable::AboutAnExample { step: 1, term: "360".into() })
        );
        let train = shown("A train leaves at 9:40 and travels 275 km. When does it arrive?", &["Solve it."]);
        let hiking = "Jan hikes 12 km at 4 km/h. How long does the hike take?";
        let p = plan(&["List the steps needed to find the arrival time of the train."]);
        assert_eq!(check(&p, &train, hiking, true), Some(Unusable::AboutAnExample { step: 0, term: "train".into() }));
        // Common words and the question's own words are not an example's.
        assert_eq!(check(&plan(&["Write a Python function for the hike's time in km."]), &train, hiking, true), None);
        // Nor are the words of any instruction: what a function returns, in minutes, signs, logs.
        let examples = [
            shown("Write a Python function that returns the n-th Fibonacci number in O(log n) time.", &["Write it."]),
            shown("How many positive divisors does 360 have?", &["Factor it."]),
            shown("A train stops for 12 minutes. When does it arrive?", &["Solve it."]),
        ]
        .concat();
        let question = "Jan hikes 12 km at 4 km/h. How long does the hike take?";
        let p =
            plan(&["Work out the hike's length in minutes; check the result is positive.", "State what it returns."]);
        assert_eq!(check(&p, &examples, question, true), None);
        let p = plan(&["Take the log of each side."]);
        assert_eq!(check(&p, &examples, question, true), None);
    }
}
