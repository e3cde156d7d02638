//! What both wire formats read from a request the same way: a body checked against the fields
//! a format documents, the model, the messages sorted into instructions and turns, Baton's own
//! headers, and the [`Call`] a checked request becomes. Each format's own fields and shapes stay
//! in its module (`chat`, `responses`).

use axum::http::HeaderMap;
use baton_engine::limits;
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

/// The most output tokens a request may ask for: the pool file's bound for a worker's `max_tokens`.
pub(crate) const MAX_OUTPUT_TOKENS: u32 = 10_000_000;

/// A token count in the body, from 1 to [`MAX_OUTPUT_TOKENS`].
pub(crate) fn output_tokens(body: &Map<String, Value>, name: &str) -> Result<Option<u32>, ApiError> {
    match number(body, name)? {
        None => Ok(None),
        Some(n) if n.fract() == 0.0 && (1.0..=MAX_OUTPUT_TOKENS as f64).contains(&n) => Ok(Some(n as u32)),
        Some(n) => Err(ApiError::bad_field(
            name,
            format!("`{name}` must be a whole number from 1 to {MAX_OUTPUT_TOKENS}; got {n}"),
        )),
    }
}

pub(crate) fn number(body: &Map<String, Value>, name: &str) -> Result<Option<f64>, ApiError> {
    match body.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_f64().map(Some).ok_or_else(|| ApiError::bad_field(name, format!("`{name}` must be a number"))),
    }
}

/// The answer's settings: `max_tokens` as the format reads it, then `temperature` and `top_p`,
/// each in the range the providers take ([`limits`]).
pub(crate) fn answer(body: &Map<String, Value>, max_tokens: Option<u32>) -> Result<AnswerSettings, ApiError> {
    let in_range = |name: &str, range: limits::Range| -> Result<Option<f32>, ApiError> {
        let Some(value) = number(body, name)? else { return Ok(None) };
        let value = range.check(&format!("`{name}`"), value).map_err(|m| ApiError::bad_field(name, m))?;
        Ok(Some(value as f32))
    };
    let temperature = in_range("temperature", limits::TEMPERATURE)?;
    let top_p = in_range("top_p", limits::TOP_P)?;
    Ok(AnswerSettings { max_tokens, temperature, top_p })
}

/// The header `name`'s text, if the request has it.
fn header_text<'h>(headers: &'h HeaderMap, name: &str) -> Result<Option<&'h str>, ApiError> {
    let Some(value) = headers.get(name) else { return Ok(None) };
    value.to_str().map(|v| Some(v.trim())).map_err(|_| ApiError::bad_request(format!("the header {name} is not text")))
}

/// A whole-number header from 1 to `max` (`inf`, `nan`, fractions and signs refused).
fn header_whole(headers: &HeaderMap, name: &str, max: u64) -> Result<Option<u64>, ApiError> {
    let Some(text) = header_text(headers, name)? else { return Ok(None) };
    match text.parse::<u64>() {
        Ok(n) if (1..=max).contains(&n) => Ok(Some(n)),
        _ => Err(ApiError::bad_request(format!(
            "the header {name} must be a whole number from 1 to {max}; got {text:?}"
        ))),
    }
}

/// The most tokens a request may cap itself at: the pool file's own bound for `max_tokens`.
const MAX_TOKENS_CAP: u64 = i64::MAX as u64;

/// A request's own caps (`x-baton-max-cost-usd`, `x-baton-max-tokens`): the executor applies
/// the tighter of these and the pool's, so a request can lower a cap and never raise it.
pub(crate) fn budget(headers: &HeaderMap) -> Result<Option<Budget>, ApiError> {
    let name = "x-baton-max-cost-usd";
    let cost = header_text(headers, name)?
        .map(|text| limits::COST_USD.parse(&format!("the header {name}"), text))
        .transpose()
        .map_err(ApiError::bad_request)?;
    let tokens = header_whole(headers, "x-baton-max-tokens", MAX_TOKENS_CAP)?;
    Ok((cost.is_some() || tokens.is_some()).then_some(Budget {
        max_calls: None,
        max_tokens: tokens,
        max_cost_usd: cost,
    }))
}

/// `x-baton-conversation`: the history's conversation a request continues, if it names one.
pub(crate) fn conversation(headers: &HeaderMap) -> Result<Option<i64>, ApiError> {
    Ok(header_whole(headers, "x-baton-conversation", i64::MAX as u64)?.map(|c| c as i64))
}
