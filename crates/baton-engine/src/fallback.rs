//! When a conductor's plan is not a plan for the question, and what runs instead.
//!
//! A small conductor often writes a plan that parses but cannot answer: it repeats one of the
//! prompt's example workflows (a Fibonacci review for a word problem), or its subtasks describe
//! the question without its numbers while the workers never see the question itself, or its
//! subtasks loop (the same phrase over and over until the token limit). Such a
//! plan is asked for once more, differently; if that one is no better, the question goes to
//! one worker alone, verbatim (the pool's best, when what it learned says which). The run says
//! that it fell back and why.
//!
//! What the pool learned (`baton pool learn`) may also send a question straight to one worker,
//! with no plan at all: [`route`].

use baton_plan::{Access, Plan, Step};
use std::collections::{BTreeMap, HashMap, HashSet};

use baton_providers::{Message, Role};

use crate::planner::ShownExample;
use crate::pool::{FallbackOptions, Route};
// What the pool learned is a pool option (the pool holds it); it stays reachable here,
// beside the choice it feeds.
pub use crate::pool::{Choices, MIN_CATEGORY_ITEMS, Measured};

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

/// Words too common to tell one question from another: English's own, and the words any
/// instruction uses whatever its subject (what a function returns, units of time, signs,
/// logarithms), which a plan for the user's question says without having read an example.
const COMMON: &[&str] = &[
    "the", "and", "for", "are", "but", "not", "you", "all", "any", "can", "has", "have", "had", "was", "its", "our",
    "with", "that", "this", "these", "those", "from", "into", "than", "then", "when", "what", "which", "who", "whom",
    "why", "how", "many", "much", "does", "did", "will", "would", "should", "could", "each", "every", "other", "one",
    "two", "three", "four", "five", "first", "second", "last", "more", "most", "less", "least", "larger", "smaller",
    "write", "python", "function", "code", "program", "number", "numbers", "answer", "question", "give", "explain",
    "find", "value", "time", "about", "there", "their", "them", "they", "such", "some", "only", "also", "over",
    "return", "returns", "returned", "log", "logs", "positive", "negative", "minute", "minutes", "hour", "hours",
    "seconds", "day", "days", "make", "makes", "made", "up", "per", "total", "sum", "result", "results", "step",
    "steps", "list", "count", "check", "compare", "final", "correct", "option", "options", "letter", "choose",
];

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

/// Lower-case words of letters and digits; everything else separates them.
fn words(text: &str) -> Vec<String> {
    text.split(|c: char| !c.is_alphanumeric()).filter(|w| !w.is_empty()).map(str::to_lowercase).collect()
}

/// How many learned questions vote on a new question's category, and how alike (shared
/// distinctive words over all of either's, Jaccard) the nearest must be for the vote to count.
const NEIGHBOURS: usize = 3;
const MIN_LIKENESS: f64 = 0.12;

/// Where what the pool learned places a question: the worker for its category, and why that
/// choice is clear, if it is.
struct Placed<'a> {
    worker: usize,
    /// Why it answers alone, without a plan ([`Choices::alone`]); `None`: the conductor plans.
    alone: Option<&'a String>,
    /// The category ("chemistry") or kind ("multiple-choice questions") it was placed by.
    at: String,
    /// How it was placed, in words: "the question is like its chemistry items".
    how: String,
}

/// The worker the profiles name for `question`: its category's, where the learned questions
/// nearest to it place it in a category with a choice of its own; else its kind's, where its
/// form tells the kind ([`kind_of`]); `None` when neither does.
fn placed<'a>(m: &'a Measured, workers: usize, question: &str) -> Option<Placed<'a>> {
    let valid = |w: Option<usize>| w.filter(|w| *w < workers);
    if let Some(category) = category_of(question, &m.questions)
        && let Some(worker) = valid(m.by_category.best.get(category).copied())
    {
        let how = format!("the question is like its {category} items");
        let alone = m.by_category.alone(category);
        return Some(Placed { worker, alone, at: category.to_owned(), how });
    }
    let kind = kind_of(question, m.by_kind.best.keys())?;
    let worker = valid(m.by_kind.best.get(kind).copied())?;
    let words = crate::profile::kind_words(kind);
    let how = format!("the question is a {words} one, and no learned category is like it");
    Some(Placed { worker, alone: m.by_kind.alone(kind), at: format!("{words} questions"), how })
}

/// Which worker answers alone when the plans cannot be used, and why that one (`None`: no
/// measurement chose it). The user's `fallback_worker` first; then what the pool learned: the
/// cheapest worker as good at the question's category, when the learned questions nearest to
/// it say which category that is, or else at its kind; then the best overall; else the first
/// worker.
pub fn fallback_worker(options: &FallbackOptions, workers: usize, question: &str) -> (usize, Option<String>) {
    let valid = |w: Option<usize>| w.filter(|w| *w < workers);
    if options.chosen
        && let Some(w) = valid(options.worker)
    {
        return (w, None);
    }
    let m = &options.measured;
    if let Some(p) = placed(m, workers, question) {
        return (p.worker, Some(format!("the cheapest as good at {} when this pool learned", p.at)));
    }
    if let Some(w) = valid(m.best) {
        return (w, Some("the best alone when this pool learned".into()));
    }
    (valid(options.worker).unwrap_or(0), None)
}

/// Whether the question goes straight to one worker, with no plan, and why: with
/// [`Route::Auto`], when the learned profile names the worker for the question's category (or,
/// where no category places it, its kind) by a clear margin, or the conductor's plans were
/// measured there and not shown to do better than that worker alone; with [`Route::Always`], to the
/// profile's worker for the category or kind, else the best overall, else the fallback worker.
/// A worker the user chose (`fallback_worker`) turns [`Route::Auto`]'s routing off, since it
/// is the user's choice, not a measurement; with [`Route::Always`] every question goes to it.
///
/// The reason starts with [`ROUTED`]: a routed run is told apart from one whose plans failed by
/// its `PlanReady::fallback` reason ([`is_routed`]).
pub fn route(options: &FallbackOptions, workers: usize, question: &str) -> Option<(usize, String)> {
    if options.chosen {
        let valid = options.worker.filter(|w| *w < workers);
        return match (options.route, valid) {
            (Route::Always, Some(w)) => Some((w, "routed to the pool's fallback_worker (route = always)".to_owned())),
            _ => None,
        };
    }
    match options.route {
        Route::Never => None,
        Route::Auto => {
            let p = placed(&options.measured, workers, question)?;
            let why = p.alone?;
            Some((p.worker, format!("routed by what the pool learned: {}, and {why}", p.how)))
        }
        // The fallback's own choice: the category's worker, else the best overall.
        Route::Always => Some(match fallback_worker(options, workers, question) {
            (w, Some(why)) => (w, format!("routed by what the pool learned: {why}")),
            (w, None) => (w, "routed: nothing learned places this question".to_owned()),
        }),
    }
}

/// The kind of `question` among the `learned` kinds, as far as its form tells: options
/// lettered A, B, … on lines of their own make it `choice`; a Python function's signature or
/// a fenced block of code, `code`; any other question is the one other kind learned (`number`
/// or `exact`), if just one was. `None` when the form names a kind not learned, or leaves two
/// open.
pub fn kind_of<'a>(question: &str, learned: impl Iterator<Item = &'a String>) -> Option<&'a str> {
    let learned: Vec<&'a String> = learned.collect();
    let find = |kind: &str| learned.iter().find(|k| k.as_str() == kind).map(|k| k.as_str());
    if has_lettered_options(question) {
        return find("choice");
    }
    if shows_code(question) {
        return find("code");
    }
    let mut open = learned.iter().filter(|k| !matches!(k.as_str(), "choice" | "code"));
    match (open.next(), open.next()) {
        (Some(one), None) => Some(one.as_str()),
        _ => None,
    }
}

/// Whether `question` offers lettered options: "A" and "B" each opening a line of its own as
/// "A.", "A)", "(A)" or "A:". One lettered line is no options ("A. Lincoln …"). The one rule
/// for routing by kind ([`kind_of`]) and for the conductor's choice of examples, so the two
/// never disagree on what a multiple-choice question is.
pub fn has_lettered_options(question: &str) -> bool {
    let option = |line: &str, letter: char| {
        let line = line.trim_start();
        let line = line.strip_prefix('(').unwrap_or(line);
        let mut chars = line.chars();
        chars.next().map(|c| c.to_ascii_uppercase()) == Some(letter) && matches!(chars.next(), Some('.' | ')' | ':'))
    };
    let lettered = |letter: char| question.lines().any(|line| option(line, letter));
    lettered('A') && lettered('B')
}

/// Whether `question` shows code: a fenced block, or a Python function's signature.
pub fn shows_code(question: &str) -> bool {
    question.contains("```") || (question.contains("def ") && question.contains("):"))
}

/// The category of the learned questions most like `question`, by a vote of the
/// [`NEIGHBOURS`] nearest weighted by likeness; `None` when none is alike enough.
pub fn category_of<'a>(question: &str, evaluated: &'a [(String, String)]) -> Option<&'a str> {
    let mine = distinctive(question);
    if mine.is_empty() {
        return None;
    }
    let mut near: Vec<(f64, &str)> = evaluated
        .iter()
        .map(|(q, category)| {
            let theirs = distinctive(q);
            let shared = mine.intersection(&theirs).count() as f64;
            let all = mine.union(&theirs).count() as f64;
            (if all > 0.0 { shared / all } else { 0.0 }, category.as_str())
        })
        .filter(|(likeness, _)| *likeness >= MIN_LIKENESS)
        .collect();
    near.sort_by(|a, b| b.0.total_cmp(&a.0));
    near.truncate(NEIGHBOURS);
    let mut votes: BTreeMap<&str, f64> = BTreeMap::new();
    for (likeness, category) in near {
        *votes.entry(category).or_default() += likeness;
    }
    votes.into_iter().max_by(|a, b| a.1.total_cmp(&b.1)).map(|(c, _)| c)
}

/// A text's words that can tell one subject from another: three letters or more, not common.
fn distinctive(text: &str) -> HashSet<String> {
    words(text).into_iter().filter(|w| w.chars().count() >= 3 && !COMMON.contains(&w.as_str())).collect()
}

/// The one instruction a worker alone gets: the question, after the conversation so far when
/// there is one (a worker sees no history of its own).
pub fn alone_subtask(history: &[Message], question: &str) -> String {
    if history.is_empty() {
        return question.to_owned();
    }
    let mut text = String::from("The conversation so far:\n");
    for m in history {
        let who = match m.role {
            Role::User => "User",
            _ => "Assistant",
        };
        text.push_str(&format!("\n{who}: {}\n", m.content));
    }
    text.push_str(&format!("\nAnswer the user's new message:\n\n{question}"));
    text
}

/// How the reason of a routed question's `PlanReady::fallback` begins.
pub const ROUTED: &str = "routed";

/// Whether a `PlanReady::fallback` reason says the question was routed by what the pool learned
/// (rather than that its plans could not be used).
pub fn is_routed(reason: &str) -> bool {
    reason.starts_with(ROUTED)
}

/// The plan that runs the question on `worker` alone.
pub fn alone_plan(worker: usize, history: &[Message], question: &str) -> Plan {
    Plan {
        steps: vec![Step {
            model_id: worker,
            subtask: alone_subtask(history, question),
            access: Access::Steps(vec![]),
        }],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn the_fallback_goes_to_the_best_worker_for_the_questions_category() {
        let measured = Measured {
            best: Some(0),
            by_category: Choices { best: [("chemistry".to_owned(), 2)].into(), ..Default::default() },
            questions: vec![
                ("What is the pH of a 0.01 M solution of hydrochloric acid?".into(), "chemistry".into()),
                ("Which gas is released when zinc reacts with hydrochloric acid?".into(), "chemistry".into()),
                ("Who wrote the Federalist Papers with Madison and Jay?".into(), "history".into()),
            ],
            ..Default::default()
        };
        let mut options = FallbackOptions { measured, ..Default::default() };
        let acid = "What is the pH of a 0.1 M solution of acetic acid?";
        let (w, why) = fallback_worker(&options, 3, acid);
        assert_eq!(w, 2);
        assert!(why.unwrap().contains("chemistry"));
        // A question like none evaluated goes to the best worker overall.
        assert_eq!(category_of("Translate 'good morning' into French.", &options.measured.questions), None);
        assert_eq!(fallback_worker(&options, 3, "Translate 'good morning' into French.").0, 0);
        // A category's best that this pool does not have (a removed worker) is not used.
        assert_eq!(fallback_worker(&options, 2, acid).0, 0);
        // The user's choice wins over any measurement.
        options.worker = Some(1);
        options.chosen = true;
        assert_eq!(fallback_worker(&options, 3, acid), (1, None));
        // Nothing measured, nothing chosen: the first worker.
        assert_eq!(fallback_worker(&FallbackOptions::default(), 3, acid), (0, None));
    }

    #[test]
    fn a_question_routes_only_where_the_profile_is_clear_unless_routing_is_always() {
        let measured = Measured {
            best: Some(0),
            by_category: Choices {
                best: [("chemistry".to_owned(), 2), ("history".to_owned(), 1)].into(),
                clear: [("chemistry".to_owned(), "c was right on 8 of 8".to_owned())].into(),
                ..Default::default()
            },
            questions: vec![
                ("What is the pH of a 0.01 M solution of hydrochloric acid?".into(), "chemistry".into()),
                ("Who wrote the Federalist Papers with Madison and Jay?".into(), "history".into()),
            ],
            ..Default::default()
        };
        let mut options = FallbackOptions { measured, ..Default::default() };
        let acid = "What is the pH of a 0.1 M solution of acetic acid?";
        let papers = "Who wrote the Federalist Papers?";
        let (w, why) = route(&options, 3, acid).expect("chemistry is clear");
        assert_eq!(w, 2);
        assert!(why.contains("chemistry") && why.contains("8 of 8"), "{why}");
        assert_eq!(route(&options, 3, papers), None, "history's choice is not clear: the conductor plans");
        assert_eq!(route(&options, 2, acid), None, "a worker the pool no longer has");
        options.route = Route::Always;
        assert_eq!(route(&options, 3, papers).map(|r| r.0), Some(1));
        assert_eq!(route(&options, 3, "Translate 'good morning' into French.").map(|r| r.0), Some(0));
        options.route = Route::Never;
        assert_eq!(route(&options, 3, acid), None);
        // The user's worker: no routing by measurement, but `always` sends everything to it.
        options.worker = Some(1);
        options.chosen = true;
        options.route = Route::Auto;
        assert_eq!(route(&options, 3, acid), None);
        options.route = Route::Always;
        assert_eq!(route(&options, 3, acid).map(|r| r.0), Some(1));

        // Where the conductor's plans were not shown to do better than history's worker alone, it
        // answers alone.
        let mut options = FallbackOptions { measured: options.measured.clone(), ..Default::default() };
        let why = "the conductor's plans were right on 3 of 8 when the pool learned, b alone on 4 of 8: a plan is not known to help";
        options.measured.by_category.no_gain.insert("history".into(), why.into());
        let (w, said) = route(&options, 3, papers).expect("no gain: alone");
        assert_eq!(w, 1);
        assert!(said.ends_with(why), "{said}");
    }

    #[test]
    fn a_question_no_category_places_goes_to_the_worker_of_its_kind() {
        let measured = Measured {
            best: Some(0),
            by_category: Choices {
                best: [("chemistry".to_owned(), 0)].into(),
                clear: [("chemistry".to_owned(), "a was right on 8 of 8".to_owned())].into(),
                ..Default::default()
            },
            by_kind: Choices {
                best: [("choice".to_owned(), 1), ("number".to_owned(), 2)].into(),
                clear: [("choice".to_owned(), "b was right on 18 of 20".to_owned())].into(),
                ..Default::default()
            },
            questions: vec![("What is the pH of a 0.01 M solution of hydrochloric acid?".into(), "chemistry".into())],
            ..Default::default()
        };
        let options = FallbackOptions { measured, ..Default::default() };
        let anatomy = "Which bone is the longest?\n\nA. femur\nB. tibia\nC. ulna\nD. radius";
        let (w, why) = route(&options, 3, anatomy).expect("multiple choice is clear");
        assert_eq!(w, 1);
        assert!(why.contains("a multiple-choice one") && why.contains("18 of 20"), "{why}");
        // A question its category places goes by the category, whatever its form.
        let acid = "What is the pH of a 0.1 M solution of acetic acid?\n(A) 1\n(B) 2.9";
        assert_eq!(route(&options, 3, acid).map(|r| r.0), Some(0));
        // An open question is the one open kind learned; its choice is not clear, so the
        // conductor plans, with that worker as the fallback.
        let sum = "Compute 17 times 23.";
        assert_eq!(route(&options, 3, sum), None);
        let (w, why) = fallback_worker(&options, 3, sum);
        assert_eq!(w, 2);
        assert_eq!(why.as_deref(), Some("the cheapest as good at numeric questions when this pool learned"));

        let kinds = |names: &[&str]| names.iter().map(|k| (*k).to_owned()).collect::<Vec<String>>();
        let learned = kinds(&["choice", "code", "exact", "number"]);
        assert_eq!(kind_of(anatomy, learned.iter()), Some("choice"));
        assert_eq!(kind_of("def add(a, b):\n    \"\"\"Add two numbers.\"\"\"", learned.iter()), Some("code"));
        assert_eq!(kind_of(sum, learned.iter()), None, "number or exact: the form does not tell");
        assert_eq!(kind_of(sum, kinds(&["choice", "exact"]).iter()), Some("exact"));
        assert_eq!(kind_of(anatomy, kinds(&["number"]).iter()), None, "no choice questions learned");
        assert_eq!(kind_of("Is A. Lincoln on the penny?", learned.iter()), None, "one lettered line is no options");
        assert!(has_lettered_options("Pick one.\n(a) red\n(b) blue"), "lower case and parentheses");
        assert!(has_lettered_options("Which?\nA: yes\nB: no"));
        assert!(!has_lettered_options("A. Lincoln and B. Franklin, on one line"));
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

    #[test]
    fn a_worker_alone_gets_the_question_and_the_conversation() {
        assert_eq!(alone_subtask(&[], "Why?"), "Why?");
        let history = vec![Message::user("Hi"), Message::assistant("Hello")];
        let text = alone_subtask(&history, "Why?");
        assert!(text.contains("User: Hi\n") && text.contains("Assistant: Hello\n"), "{text}");
        assert!(text.ends_with("Answer the user's new message:\n\nWhy?"));
        let p = alone_plan(2, &[], "Why?");
        assert_eq!((p.steps.len(), p.steps[0].model_id, p.steps[0].subtask.as_str()), (1, 2, "Why?"));
    }
}
