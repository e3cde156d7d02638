//! What both wire formats read from a request the same way: a body checked against the fields
//! a format documents, the model, the messages sorted into instructions and turns, Baton's own
//! headers, and the [`Call`] a checked request becomes. Each format's own fields and shapes stay
//! in its module (`chat`, `responses`).

use axum::http::HeaderMap;
use baton_engine::{AnswerSettings, Budget};
use baton_providers::{Message, Role};
use serde_json::{Map, Value};

use crate::{ApiError, Service};

/// What Baton does with one field of a request; each wire format lists its fields with one of
/// these.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Field {
    /// Read and honoured.
    Used,
    /// Accepted and not used (bookkeeping a local server has no use for).
    Ignored,
    /// Refused unless absent, `null`, or a value that asks for nothing (`n: 1`, `logprobs: false`).
    Refused(&'static str),
}

/// A request's body as a JSON object, checked against `fields` (see `check_fields`). `what`
/// names the request to send, for a body that is not JSON.
pub(crate) fn object(
    bytes: &[u8],
    what: &str,
    fields: &[(&str, Field)],
    asks_for_nothing: fn(&str, &Value) -> bool,
) -> Result<Map<String, Value>, ApiError> {
    let body: Value = serde_json::from_slice(bytes)
        .map_err(|e| ApiError::bad_request(format!("the body is not JSON ({e}); send a {what} request")))?;
    let Value::Object(body) = body else {
        return Err(ApiError::bad_request("the body must be a JSON object"));
    };
    check_fields(&body, fields, asks_for_nothing)?;
    Ok(body)
}

/// Refuses the first field of `body` that `fields` does not list (as OpenAI does), or that asks
/// for what Baton cannot do.
fn check_fields(
    body: &Map<String, Value>,
    fields: &[(&str, Field)],
    asks_for_nothing: fn(&str, &Value) -> bool,
) -> Result<(), ApiError> {
    for (name, value) in body {
        match fields.iter().find(|(f, _)| f == name).map(|(_, f)| *f) {
            None => return Err(ApiError::bad_field(name, format!("Unrecognized request argument supplied: {name}"))),
            Some(Field::Refused(why)) if !asks_for_nothing(name, value) => {
                return Err(ApiError::bad_field(name, format!("`{name}` is not supported: {why}")));
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// The body's `model` and what it names: `None` for the conductor, `Some(i)` for worker `i`
/// alone.
pub(crate) fn model(service: &Service, body: &Map<String, Value>) -> Result<(String, Option<usize>), ApiError> {
    let model = body
        .get("model")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::bad_field("model", "`model` is required: `baton`, or `baton/<worker>`"))?
        .to_owned();
    let worker = service.target(&model)?;
    Ok((model, worker))
}

/// A request, checked: what to run and how to answer.
#[derive(Debug)]
pub(crate) struct Call {
    pub(crate) model: String,
    /// `None`: the conductor plans; `Some(i)`: worker `i` alone.
    pub(crate) worker: Option<usize>,
    pub(crate) question: String,
    pub(crate) history: Vec<Message>,
    pub(crate) instructions: Option<String>,
    pub(crate) answer: AnswerSettings,
    pub(crate) stream: bool,
    pub(crate) include_usage: bool,
    pub(crate) budget: Option<Budget>,
    pub(crate) conversation: Option<i64>,
}

#[cfg(test)]
impl Call {
    pub(crate) fn for_tests() -> Call {
        Call {
            model: "baton".into(),
            worker: None,
            question: "Q?".into(),
            history: Vec::new(),
            instructions: None,
            answer: AnswerSettings::default(),
            stream: false,
            include_usage: false,
            budget: None,
            conversation: None,
        }
    }
}

/// A request's messages, sorted as they are read: the client's instructions (`system` and
/// `developer` messages) and the conversation's turns.
#[derive(Debug, Default)]
pub(crate) struct Messages {
    pub(crate) instructions: Vec<String>,
    pub(crate) turns: Vec<Message>,
}

impl Messages {
    /// Takes in message `i` of the body's list `list`, its role and its text.
    pub(crate) fn add(&mut self, list: &str, i: usize, role: &str, text: String) -> Result<(), ApiError> {
        match role {
            "system" | "developer" => self.instructions.push(text),
            "user" => self.turns.push(Message::user(text)),
            "assistant" => self.turns.push(Message::assistant(text)),
            other => {
                return Err(ApiError::bad_field(
                    &format!("{list}[{i}].role"),
                    format!("role `{other}` is not supported: use system, developer, user or assistant"),
                ));
            }
        }
        Ok(())
    }

    /// The question (the last turn, which must be the user's and not empty: else `refused`, on
    /// `list`), the turns before it, and the instructions as one text.
    pub(crate) fn split(
        mut self,
        list: &str,
        refused: &str,
    ) -> Result<(String, Vec<Message>, Option<String>), ApiError> {
        let question = match self.turns.pop() {
            Some(Message { role: Role::User, content }) if !content.trim().is_empty() => content,
            _ => return Err(ApiError::bad_field(list, refused)),
        };
        let instructions = (!self.instructions.is_empty()).then(|| self.instructions.join("\n\n"));
        Ok((question, self.turns, instructions))
    }
}

/// The text of `content`, of message `at` in the body's list `list`: a string, or parts whose
/// types are among `kinds` (anything else is refused).
pub(crate) fn text_of(content: &Value, list: &str, at: usize, kinds: &[&str]) -> Result<String, ApiError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut text = String::new();
            for (j, part) in parts.iter().enumerate() {
                let kind = part.get("type").and_then(Value::as_str).unwrap_or("");
                if !kinds.contains(&kind) {
                    return Err(ApiError::bad_field(
                        &format!("{list}[{at}].content[{j}].type"),
                        format!("only text parts are supported, not `{kind}`"),
                    ));
                }
                text.push_str(part.get("text").and_then(Value::as_str).unwrap_or(""));
            }
            Ok(text)
        }
        _ => Err(ApiError::bad_field(&format!("{list}[{at}].content"), "content must be a string or text parts")),
    }
}

/// Refuses a list of `count` messages over the server's limit, on `list`; `noun` is what the
/// list holds.
pub(crate) fn within_limit(service: &Service, list: &str, count: usize, noun: &str) -> Result<(), ApiError> {
    if count > service.options.max_messages {
        return Err(ApiError::bad_field(
            list,
            format!("{count} {noun} is over this server's limit of {}", service.options.max_messages),
        ));
    }
    Ok(())
}

pub(crate) fn number(body: &Map<String, Value>, name: &str) -> Result<Option<f64>, ApiError> {
    match body.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_f64().map(Some).ok_or_else(|| ApiError::bad_field(name, format!("`{name}` must be a number"))),
    }
}

/// The answer's settings: `max_tokens` as the format reads it, then `temperature` and `top_p`.
pub(crate) fn answer(body: &Map<String, Value>, max_tokens: Option<u32>) -> Result<AnswerSettings, ApiError> {
    let temperature = number(body, "temperature")?.map(|t| t as f32);
    let top_p = number(body, "top_p")?.map(|t| t as f32);
    Ok(AnswerSettings { max_tokens, temperature, top_p })
}

fn header_number(headers: &HeaderMap, name: &str) -> Result<Option<f64>, ApiError> {
    let Some(value) = headers.get(name) else { return Ok(None) };
    let parsed = value.to_str().ok().and_then(|v| v.trim().parse::<f64>().ok()).filter(|v| *v > 0.0);
    parsed.map(Some).ok_or_else(|| ApiError::bad_request(format!("the header {name} must be a number above 0")))
}

/// A request's own caps (`x-baton-max-cost-usd`, `x-baton-max-tokens`): the executor applies
/// the tighter of these and the pool's, so a request can lower a cap and never raise it.
pub(crate) fn budget(headers: &HeaderMap) -> Result<Option<Budget>, ApiError> {
    let cost = header_number(headers, "x-baton-max-cost-usd")?;
    let tokens = header_number(headers, "x-baton-max-tokens")?.map(|t| t as u64);
    Ok((cost.is_some() || tokens.is_some()).then_some(Budget {
        max_calls: None,
        max_tokens: tokens,
        max_cost_usd: cost,
    }))
}

/// `x-baton-conversation`: the history's conversation a request continues, if it names one.
pub(crate) fn conversation(headers: &HeaderMap) -> Result<Option<i64>, ApiError> {
    Ok(header_number(headers, "x-baton-conversation")?.map(|c| c as i64))
}
