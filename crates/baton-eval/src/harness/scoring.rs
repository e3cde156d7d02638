//! Scoring: an answer checked against its item by the documented extraction rules (code run in
//! the sandbox), and best-of-n's vote among its samples.

use super::EvalError;
use crate::extract;
use crate::sandbox::Sandbox;
use crate::suite::{Item, Kind};

/// An answer checked against the item.
#[derive(Debug, Clone, PartialEq)]
pub struct Scored {
    pub extracted: Option<String>,
    pub correct: bool,
    /// Why it could not be right beyond its content (no answer, the sandbox stopped it).
    pub error: Option<String>,
}

/// Scores `answer` for `item` (code items run in `sandbox`).
pub async fn score(sandbox: Option<&Sandbox>, item: &Item, answer: Option<&str>) -> Result<Scored, EvalError> {
    let Some(answer) = answer.filter(|a| !a.trim().is_empty()) else {
        return Ok(Scored { extracted: None, correct: false, error: Some("no answer".into()) });
    };
    Ok(match item.kind {
        Kind::Number => {
            let extracted = extract::extract_number(answer);
            let correct =
                match (extracted.as_deref().and_then(extract::parse_number), extract::parse_number(&item.answer)) {
                    (Some(a), Some(b)) => extract::same_number(a, b),
                    _ => false,
                };
            Scored { extracted, correct, error: None }
        }
        Kind::Choice => {
            let extracted = extract::extract_choice(answer, item.option_count()).map(String::from);
            let correct = extracted.as_deref() == Some(item.answer.as_str());
            Scored { extracted, correct, error: None }
        }
        Kind::Exact => {
            let extracted = extract::extract_exact(answer);
            let correct = extracted.as_deref().is_some_and(|e| {
                match (extract::parse_number(e), extract::parse_number(&item.answer)) {
                    (Some(a), Some(b)) => extract::same_number(a, b),
                    _ => extract::normalize_exact(e) == extract::normalize_exact(&item.answer),
                }
            });
            Scored { extracted, correct, error: None }
        }
        Kind::Code => {
            let code = extract::extract_code(answer);
            let sandbox = sandbox.ok_or_else(|| EvalError::Settings("code items need the sandbox".into()))?;
            // Only Python goes before the answer: prose there would be a syntax error.
            let program = Sandbox::program(
                item.code_prefix(&code),
                &code,
                item.tests.as_deref().unwrap_or_default(),
                item.entry_point.as_deref().unwrap_or_default(),
            );
            let out = sandbox.run(&program).await?;
            Scored { extracted: Some(code), correct: out.passed, error: out.reason }
        }
    })
}

/// The key two answers agree on, for voting.
fn vote_key(item: &Item, answer: &str) -> Option<String> {
    match item.kind {
        Kind::Number => {
            extract::extract_number(answer).and_then(|e| extract::parse_number(&e)).map(|v| format!("{v:.9}"))
        }
        Kind::Choice => extract::extract_choice(answer, item.option_count()).map(String::from),
        Kind::Exact => extract::extract_exact(answer).map(|e| extract::normalize_exact(&e)),
        Kind::Code => None,
    }
}

/// Self-consistency: the answer whose extracted form is most common (ties: the earliest).
/// Code answers cannot be compared this way; the first sample stands.
pub(super) fn vote<'a>(item: &Item, answers: impl Iterator<Item = &'a str>) -> Option<String> {
    let answers: Vec<&str> = answers.collect();
    let mut counts: Vec<(String, usize, usize)> = Vec::new(); // key, count, first index
    for (i, a) in answers.iter().enumerate() {
        let Some(k) = vote_key(item, a) else { continue };
        match counts.iter_mut().find(|(key, _, _)| *key == k) {
            Some(c) => c.1 += 1,
            None => counts.push((k, 1, i)),
        }
    }
    let best = counts.iter().max_by(|a, b| a.1.cmp(&b.1).then(b.2.cmp(&a.2)));
    match best {
        Some((_, _, first)) => Some(answers[*first].to_owned()),
        None => answers.first().map(|a| (*a).to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::harness::items::tests::item;
    use crate::harness::prompt;

    #[test]
    fn votes_take_the_most_common_answer() {
        let it = item("x", "a");
        let answers = ["#### 2", "so 1\n#### 1", "#### 1.0", "#### 2"];
        // 1 and 2 tie at two votes; 2 came first.
        assert_eq!(vote(&it, answers.iter().copied()).as_deref(), Some("#### 2"));
        let answers = ["#### 3", "#### 1", "#### 1.0"];
        assert_eq!(vote(&it, answers.iter().copied()).as_deref(), Some("#### 1"));
        assert_eq!(vote(&it, std::iter::empty()), None);
    }

    fn code_item(question: &str, prompt: Option<&str>) -> Item {
        Item {
            id: "c".into(),
            question: question.into(),
            answer: String::new(),
            kind: Kind::Code,
            category: None,
            choices: None,
            entry_point: Some("add".into()),
            tests: Some("def check(candidate):\n    assert candidate(2, 3) == 5\n".into()),
            prompt: prompt.map(str::to_owned),
            split: None,
        }
    }

    /// A prose item (MBPP's form), a stub item (HumanEval's) and prose with a separate stub are
    /// each worded for their form and scored right for a right answer, wrong for a wrong one.
    #[tokio::test]
    async fn code_items_are_scored_in_the_form_they_are_written() {
        let sandbox = Sandbox::new(crate::sandbox::Limits::default()).expect("python for the sandbox");
        let prose = code_item("Write a function that adds two numbers.", None);
        let stub = code_item("def add(a, b):\n    \"\"\"Add two numbers.\"\"\"\n", None);
        // A stub is valid Python on its own (HumanEval's have a docstring for a body), so a whole
        // function written after it replaces it.
        let both = code_item("Add two numbers.", Some("import math\n\ndef add(a, b):\n    \"\"\"Add.\"\"\"\n"));
        assert!(prompt(&prose).contains("Python function named `add`"), "{}", prompt(&prose));
        assert!(!prompt(&prose).contains("above"));
        assert!(
            prompt(&stub).starts_with("def add(a, b):") && prompt(&stub).contains("Complete the Python function above")
        );
        assert!(
            prompt(&both).contains("```python\nimport math\n\ndef add(a, b):\n    \"\"\"Add.\"\"\"\n```"),
            "{}",
            prompt(&both)
        );
        let right = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```";
        let wrong = "```python\ndef add(a, b):\n    return a - b\n```";
        for item in [&prose, &stub, &both] {
            let scored = score(Some(&sandbox), item, Some(right)).await.expect("scored");
            assert!(scored.correct, "{}: {scored:?}", item.question);
            let scored = score(Some(&sandbox), item, Some(wrong)).await.expect("scored");
            assert!(!scored.correct, "{}: {scored:?}", item.question);
        }
        // A body alone completes a stub (HumanEval's canonical form).
        let body = "```python\n    return a + b\n```";
        assert!(score(Some(&sandbox), &stub, Some(body)).await.expect("scored").correct);

        // Prose that names the signature is still prose: it is not put before the answer.
        let named = code_item("Write a Python function `def add(a, b)` that returns a + b.", None);
        assert_eq!(named.code_stub(), None);
        assert!(score(Some(&sandbox), &named, Some(right)).await.expect("scored").correct);
        assert!(!score(Some(&sandbox), &named, Some(wrong)).await.expect("scored").correct);
        // A whole function runs as it is, after what the stub has before the entry point (here
        // a helper it uses); a stub whose signature line alone would not parse before it is
        // no obstacle.
        let helper = code_item("Add.", Some("import math\n\ndef twice(x):\n    return 2 * x\n\ndef add(a, b):\n"));
        let uses = "```python\ndef add(a, b):\n    return twice(a + b) // 2\n```";
        assert_eq!(helper.code_prefix(uses), "import math\n\ndef twice(x):\n    return 2 * x\n\n");
        assert!(score(Some(&sandbox), &helper, Some(uses)).await.expect("scored").correct);
    }
}
