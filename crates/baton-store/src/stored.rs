//! How texts are kept once: the stored forms of step requests and events, and their way back.
//!
//! A worker at step *i* is sent the subtask and answer of every step it sees, so stored as
//! sent, an answer would be kept once per step that saw it (and again in each `step_started`
//! event): a plan whose steps all see each other would grow with the square of its answers.
//! Instead the recorder stores a request as references to the step rows that hold those texts
//! ([`StoredRequest::Refs`]), and an event with the texts a row holds left out ([`elide`]);
//! reading a run puts them back ([`Texts`]), so what the history returns is what was sent and
//! what happened, as it was. Rows written before this (whole requests, whole events) read as
//! they are.

use std::collections::HashMap;

use baton_providers::{Message, Role};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{RunRecord, SentRequest, StoreError, decode};

/// Where a text of a run is kept: the subtask or the output of step `(round, step)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TextRef {
    Subtask(u32, usize),
    Output(u32, usize),
}

/// A step's request as `steps.request` holds it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub(crate) enum StoredRequest {
    /// Turns that refer to the texts of the run's steps (written since migration 5).
    Refs { system: Option<String>, turns: Vec<Turn> },
    /// The request as sent (written before migration 5).
    Whole(SentRequest),
}

/// One turn of a stored request: a reference to a step's subtask or output, or the text itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub(crate) enum Turn {
    Subtask { role: Role, subtask: (u32, usize) },
    Output { role: Role, output: (u32, usize) },
    Text { role: Role, content: String },
}

impl StoredRequest {
    /// `messages` as references to the texts `known` finds in the run's rows, literally elsewhere.
    pub(crate) fn refer(system: Option<String>, messages: &[Message], known: impl Fn(&str) -> Option<TextRef>) -> Self {
        let turns = messages
            .iter()
            .map(|m| match known(&m.content) {
                Some(TextRef::Subtask(round, step)) => Turn::Subtask { role: m.role, subtask: (round, step) },
                Some(TextRef::Output(round, step)) => Turn::Output { role: m.role, output: (round, step) },
                None => Turn::Text { role: m.role, content: m.content.clone() },
            })
            .collect();
        StoredRequest::Refs { system, turns }
    }
}

/// The event as stored: `event`'s JSON with each text a row holds set to null, and the names of
/// those fields (a JSON array for `events.elided`; `None` when nothing was left out).
pub(crate) fn elide(event: &baton_engine::RunEvent) -> (Value, Option<String>) {
    let mut value = serde_json::to_value(event).unwrap_or(Value::Null);
    let fields: &[&str] = match value.get("type").and_then(Value::as_str) {
        Some("run_started") => &["question"],
        Some("plan_ready") => &["plan", "raw"],
        Some("step_started") => &["system", "messages"],
        Some("step_finished" | "step_reused") => &["output"],
        Some("run_finished") => &["answer"],
        _ => &[],
    };
    let mut elided = Vec::new();
    if let Value::Object(map) = &mut value {
        for field in fields {
            // An absent field (a given plan has no `raw`) stays absent.
            if let Some(v) = map.get_mut(*field) {
                *v = Value::Null;
                elided.push(*field);
            }
        }
    }
    let elided = (!elided.is_empty()).then(|| serde_json::to_string(&elided).unwrap_or_default());
    (value, elided)
}

/// A run's texts as its rows hold them, to put back what its requests and events refer to.
pub(crate) struct Texts<'a> {
    pub run: &'a RunRecord,
    /// Each round's plan (as JSON) and the conductor's text.
    pub plans: HashMap<u32, (Value, Option<&'a str>)>,
    /// Each step's subtask and output.
    pub steps: HashMap<(u32, usize), (&'a str, Option<&'a str>)>,
}

impl Texts<'_> {
    /// The request `stored` stands for, as it was sent.
    pub(crate) fn request(&self, stored: StoredRequest) -> Result<SentRequest, StoreError> {
        let (system, turns) = match stored {
            StoredRequest::Whole(request) => return Ok(request),
            StoredRequest::Refs { system, turns } => (system, turns),
        };
        let messages = turns
            .into_iter()
            .map(|turn| {
                let (role, content) = match turn {
                    Turn::Text { role, content } => (role, content),
                    Turn::Subtask { role, subtask } => (role, self.subtask(subtask)?.to_owned()),
                    Turn::Output { role, output } => (role, self.output(output)?.to_owned()),
                };
                Ok(Message { role, content })
            })
            .collect::<Result<_, StoreError>>()?;
        Ok(SentRequest { system, messages })
    }

    fn subtask(&self, (round, step): (u32, usize)) -> Result<&str, StoreError> {
        self.steps.get(&(round, step)).map(|(subtask, _)| *subtask).ok_or_else(|| missing("subtask", round, step))
    }

    fn output(&self, (round, step): (u32, usize)) -> Result<&str, StoreError> {
        self.steps.get(&(round, step)).and_then(|(_, output)| *output).ok_or_else(|| missing("output", round, step))
    }

    /// Puts the texts named in `elided` (the `events.elided` column) back into `event`, each in
    /// its place.
    pub(crate) fn fill(
        &self,
        event: &mut Value,
        elided: &str,
        requests: &HashMap<(u32, usize), SentRequest>,
    ) -> Result<(), StoreError> {
        let fields: Vec<String> = serde_json::from_str(elided).map_err(|e| decode("events.elided", e))?;
        let at = |key: &str| event.get(key).and_then(Value::as_u64);
        let (round, step) = (at("round").map(|r| r as u32), at("step").map(|s| s as usize));
        for field in fields {
            let text = match (field.as_str(), round, step) {
                ("question", _, _) => Some(Value::from(self.run.question.as_str())),
                ("answer", _, _) => self.run.answer.as_deref().map(Value::from),
                ("plan", Some(r), _) => self.plans.get(&r).map(|(plan, _)| plan.clone()),
                ("raw", Some(r), _) => self.plans.get(&r).and_then(|(_, raw)| raw.map(Value::from)),
                ("output", Some(r), Some(s)) => self.output((r, s)).ok().map(Value::from),
                ("system", Some(r), Some(s)) => {
                    requests.get(&(r, s)).map(|q| q.system.as_deref().map_or(Value::Null, Value::from))
                }
                ("messages", Some(r), Some(s)) => {
                    requests.get(&(r, s)).map(|q| serde_json::to_value(&q.messages).unwrap_or(Value::Null))
                }
                _ => None,
            };
            let Some(text) = text else {
                let kind = event.get("type").and_then(Value::as_str).unwrap_or("an");
                return Err(StoreError::Sql(sqlx::Error::Decode(
                    format!("events: the {kind} event's {field} is not in the history").into(),
                )));
            };
            event[field.as_str()] = text;
        }
        Ok(())
    }
}

fn missing(what: &str, round: u32, step: usize) -> StoreError {
    StoreError::Sql(sqlx::Error::Decode(
        format!("steps.request: refers to the {what} of round {round} step {step}, which the history does not hold")
            .into(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_refers_to_known_texts_and_keeps_the_rest() {
        let known = HashMap::from([
            ("Draft.".to_owned(), TextRef::Subtask(0, 0)),
            ("A long answer.".to_owned(), TextRef::Output(0, 0)),
        ]);
        let sent = [Message::user("Draft."), Message::assistant("A long answer."), Message::user("Unknown.")];
        let stored = StoredRequest::refer(Some("sys".into()), &sent, |t| known.get(t).copied());
        let json = serde_json::to_string(&stored).expect("json");
        assert_eq!(
            json,
            r#"{"system":"sys","turns":[{"role":"user","subtask":[0,0]},{"role":"assistant","output":[0,0]},{"role":"user","content":"Unknown."}]}"#
        );
        // A request stored whole (before references) reads as what it was.
        let whole = r#"{"system":null,"messages":[{"role":"user","content":"x"}]}"#;
        let parsed: StoredRequest = serde_json::from_str(whole).expect("whole");
        assert_eq!(parsed, StoredRequest::Whole(SentRequest { system: None, messages: vec![Message::user("x")] }));
        assert_eq!(serde_json::from_str::<StoredRequest>(&json).expect("refs"), stored);
    }
}
