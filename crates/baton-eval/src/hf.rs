//! Rows of the standard sets as published on the Hugging Face hub, made into suite items.
//!
//! Known shapes, recognised by their columns:
//!
//! | columns | set | items |
//! |---|---|---|
//! | `kind`, `question`, `answer` | Baton's own form | as they are |
//! | `question`, `answer` ending `#### N` | GSM8K (`openai/gsm8k`) | `number` |
//! | `task_id`, `prompt`, `test`, `entry_point` | HumanEval (`openai/openai_humaneval`) | `code` |
//! | `question`, `choices`, `answer` (index or letter), `subject`? | MMLU (`cais/mmlu`) | `choice`, options lettered A.. in the question |
//! | `problem`, `answer`, `subject`? | MATH (`HuggingFaceH4/MATH-500`) | `number` when the answer is a number, else `exact` |
//!
//! Anything else is refused with the columns found, so a user can convert it to JSONL.

use serde_json::{Value, json};

use crate::extract;
use crate::suite::{self, Suite, SuiteError};

/// The items of `rows` (a split of `dataset`), as a suite named `name`.
pub fn suite_from_rows(name: &str, dataset: &str, rows: &[Value]) -> Result<Suite, SuiteError> {
    let mut text = String::new();
    for (i, row) in rows.iter().enumerate() {
        let item = item(dataset, i, row).map_err(|message| SuiteError::Line {
            origin: format!("{dataset} (row {i})"),
            line: i + 1,
            message,
        })?;
        text.push_str(&item.to_string());
        text.push('\n');
    }
    suite::parse(name, &text, &format!("{dataset} on the Hugging Face hub"))
}

fn columns(row: &Value) -> String {
    row.as_object().map(|o| o.keys().cloned().collect::<Vec<_>>().join(", ")).unwrap_or_else(|| "none".into())
}

fn item(dataset: &str, i: usize, row: &Value) -> Result<Value, String> {
    let has = |k: &str| row.get(k).is_some_and(|v| !v.is_null());
    let text = |k: &str| row.get(k).and_then(Value::as_str).map(str::to_owned);
    let id = format!("{dataset}/{i}");
    if has("kind") && has("question") {
        let mut row = row.clone();
        if row.get("id").is_none_or(Value::is_null) {
            row["id"] = json!(id);
        }
        return Ok(row);
    }
    if has("task_id") && has("prompt") && has("test") && has("entry_point") {
        return Ok(json!({
            "id": text("task_id").unwrap_or(id),
            "kind": "code",
            "question": text("prompt").unwrap_or_default(),
            "answer": text("canonical_solution").unwrap_or_default(),
            "entry_point": text("entry_point").unwrap_or_default(),
            "tests": text("test").unwrap_or_default(),
        }));
    }
    if has("question") && has("choices") {
        let choices: Vec<String> = row["choices"]
            .as_array()
            .ok_or("`choices` is not a list")?
            .iter()
            .map(|c| c.as_str().map_or_else(|| c.to_string(), str::to_owned))
            .collect();
        if !(2..=26).contains(&choices.len()) {
            return Err(format!("{} choices; 2 to 26 can be lettered", choices.len()));
        }
        let answer = match &row["answer"] {
            Value::Number(n) => {
                let k =
                    n.as_u64().filter(|k| (*k as usize) < choices.len()).ok_or("`answer` is not a choice's index")?;
                char::from(b'A' + k as u8).to_string()
            }
            Value::String(s) if s.len() == 1 && s.chars().all(|c| c.is_ascii_alphabetic()) => s.to_ascii_uppercase(),
            _ => return Err("`answer` is neither a choice's index nor its letter".into()),
        };
        let mut question = text("question").unwrap_or_default().trim().to_owned();
        question.push('\n');
        for (k, c) in choices.iter().enumerate() {
            question.push_str(&format!("\n{}. {c}", char::from(b'A' + k as u8)));
        }
        let mut item =
            json!({ "id": id, "kind": "choice", "question": question, "choices": choices, "answer": answer });
        if let Some(subject) = text("subject") {
            item["category"] = json!(subject.replace('_', " "));
        }
        return Ok(item);
    }
    if has("question") && has("answer") {
        // GSM8K: a worked solution ending in `#### N`; the suite reader takes N.
        let answer = text("answer").ok_or("`answer` is not text")?;
        if !answer.contains("####") {
            return Err("`answer` has no `#### N` (GSM8K's form); give items a `kind`".into());
        }
        return Ok(json!({ "id": id, "question": text("question"), "answer": answer }));
    }
    if has("problem") && has("answer") {
        let answer = match &row["answer"] {
            Value::String(s) => s.clone(),
            v => v.to_string(),
        };
        let kind = if extract::parse_number(&answer).is_some() { "number" } else { "exact" };
        let mut item = json!({ "id": text("unique_id").unwrap_or(id), "kind": kind, "question": text("problem"), "answer": answer });
        if let Some(subject) = text("subject").or_else(|| text("type")) {
            item["category"] = json!(subject);
        }
        return Ok(item);
    }
    Err(format!(
        "its columns ({}) are none of the shapes Baton knows (GSM8K, HumanEval, MMLU, MATH, or items with `kind`); convert it to a JSONL suite",
        columns(row)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::suite::Kind;

    #[test]
    fn the_standard_shapes_become_items() {
        let rows = [
            json!({"question": "Six eggs a day for 3 days?", "answer": "6 * 3 = 18\n#### 18"}),
            json!({"question": "Which is a prime?", "subject": "high_school_mathematics", "choices": ["4", "6", "7", "9"], "answer": 2}),
            json!({"problem": "What is $\\frac{1}{2} + \\frac{1}{4}$?", "answer": "\\frac{3}{4}", "subject": "Algebra", "unique_id": "test/algebra/1.json"}),
            json!({"problem": "Simplify $(x+1)^2$.", "answer": "x^2+2x+1", "subject": "Algebra"}),
            json!({"task_id": "HumanEval/0", "prompt": "def f(x):\n", "canonical_solution": "    return x\n", "test": "def check(candidate):\n    assert candidate(1) == 1\n", "entry_point": "f"}),
        ];
        let suite = suite_from_rows("mixed", "some/set", &rows).expect("items");
        let kinds: Vec<Kind> = suite.items.iter().map(|i| i.kind).collect();
        assert_eq!(kinds, [Kind::Number, Kind::Choice, Kind::Number, Kind::Exact, Kind::Code]);
        assert_eq!(suite.items[0].answer, "18");
        let mmlu = &suite.items[1];
        assert_eq!(mmlu.answer, "C");
        assert_eq!(mmlu.category.as_deref(), Some("high school mathematics"));
        assert!(mmlu.question.ends_with("\n\nA. 4\nB. 6\nC. 7\nD. 9"), "{}", mmlu.question);
        assert_eq!(suite.items[2].id, "test/algebra/1.json");
        assert_eq!(suite.items[4].entry_point.as_deref(), Some("f"));
    }

    #[test]
    fn an_unknown_shape_names_its_columns() {
        let err = suite_from_rows("x", "some/set", &[json!({"text": "hello", "label": 1})]).unwrap_err().to_string();
        assert!(err.contains("text, label") || err.contains("label, text"), "{err}");
        let err = suite_from_rows("x", "s", &[json!({"question": "q", "choices": ["a", "b"], "answer": 5})])
            .unwrap_err()
            .to_string();
        assert!(err.contains("index"), "{err}");
    }
}
