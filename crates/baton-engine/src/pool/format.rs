//! The pool file's format: one serde type per table, whose values check their own type and
//! range as they are read, and a deserializer over a parsed TOML table that names the field
//! (`budget.max_calls`) in every error.
//!
//! Serde's own messages ("invalid type: string \"many\", expected u32") name neither the field
//! nor what to write, so every value here is read as TOML first and checked by hand, in the
//! words the pool's errors have always used. What needs more than one value (a remote
//! conductor's model, a worker's prices) is checked in `read.rs`.
//!
//! Fields are declared in the order the "expected one of …" messages list them: serde hands a
//! struct's field names to the deserializer in declaration order.

use std::fmt;
use std::marker::PhantomData;

use serde::de::{self, DeserializeOwned, DeserializeSeed, Deserializer, MapAccess, Visitor};
use serde::{Deserialize, forward_to_deserialize_any};

use crate::limits::{self, Range};

/// The whole file.
#[derive(Deserialize)]
pub(super) struct PoolFile {
    pub max_steps: Option<Whole<1, 64>>,
    pub show_question: Option<Flag>,
    pub question_to_answer_step: Option<Flag>,
    pub max_concurrency_per_provider: Option<Whole<1, 1024>>,
    pub budget: Option<BudgetFile>,
    pub retry: Option<RetryFile>,
    pub recursion: Option<RecursionFile>,
    pub conductor: Option<ConductorFile>,
    pub serve: Option<ServeFile>,
    /// Read one table at a time (`read.rs`), so that an error names the worker and its line.
    pub worker: Option<WorkerList>,
}

/// `[budget]`.
#[derive(Deserialize)]
pub(super) struct BudgetFile {
    pub max_calls: Option<Whole<1, { u32::MAX as i64 }>>,
    pub max_tokens: Option<Whole<1, { i64::MAX }>>,
    pub max_cost_usd: Option<Number<Cost>>,
}

/// `[retry]`.
#[derive(Deserialize)]
pub(super) struct RetryFile {
    pub max_retries: Option<Whole<0, 20>>,
    pub initial_delay_ms: Option<Whole<0, 600_000>>,
    pub max_delay_ms: Option<Whole<0, 3_600_000>>,
    pub max_retry_after_secs: Option<Whole<0, 86_400>>,
}

/// `[recursion]`.
#[derive(Deserialize)]
pub(super) struct RecursionFile {
    pub enabled: Option<Flag>,
    pub max_depth: Option<Whole<1, 8>>,
    pub max_total_steps: Option<Whole<1, 1000>>,
}

/// `[serve]`.
#[derive(Deserialize)]
pub(super) struct ServeFile {
    pub app: Option<Flag>,
    pub host: Option<Text>,
    pub port: Option<Whole<0, 65_535>>,
    pub token_env: Option<Text>,
    pub allow_origins: Option<Texts>,
    pub max_concurrent_runs: Option<Whole<1, 10_000>>,
    pub max_queued_runs: Option<Whole<0, 100_000>>,
    pub daily_max_cost_usd: Option<Number<Cost>>,
}

/// `[conductor]`. `url`, `grammar` and `device` are read as text and checked in `read.rs`, in
/// the order their messages have always come (a URL before the grammar that needs it).
#[derive(Deserialize)]
pub(super) struct ConductorFile {
    pub model: Option<Text>,
    pub url: Option<Text>,
    pub api_key_env: Option<Text>,
    pub grammar: Option<Text>,
    pub lora: Option<Text>,
    pub chat_template: Option<Text>,
    pub device: Option<Text>,
    pub isq: Option<Text>,
    pub dtype: Option<Text>,
    pub temperature: Option<Number<Temperature>>,
    pub max_reasoning_chars: Option<Whole<0, 100_000>>,
    pub max_subtask_chars: Option<Whole<1, 100_000>>,
    pub plan_time_limit_secs: Option<Whole<1, 86_400>>,
    pub timeout_secs: Option<Whole<1, 86_400>>,
    pub prompt: Option<Text>,
    pub fallback: Option<Flag>,
    pub fallback_worker: Option<Text>,
    pub route: Option<Text>,
}

/// One `[[worker]]` table. `name`, `provider` and `model` are required, and checked in
/// `read.rs` so that a missing one says "every worker needs one".
#[derive(Deserialize)]
pub(super) struct WorkerFile {
    pub name: Option<Text>,
    pub provider: Option<Text>,
    pub model: Option<Text>,
    pub base_url: Option<Text>,
    pub api_key_env: Option<Text>,
    pub max_tokens: Option<Whole<1, 10_000_000>>,
    pub temperature: Option<Number<Temperature>>,
    pub top_p: Option<Number<TopP>>,
    pub reasoning_effort: Option<Text>,
    pub thinking_budget: Option<Whole<0, 10_000_000>>,
    pub stream: Option<Flag>,
    pub timeout_secs: Option<Whole<1, 86_400>>,
    pub idle_timeout_secs: Option<Whole<1, 86_400>>,
    pub price_in: Option<Number<Price>>,
    pub price_out: Option<Number<Price>>,
    pub price_cached_in: Option<Number<Price>>,
    pub prompt_cache: Option<Flag>,
    pub description: Option<Text>,
}

/// `true` or `false`.
pub(super) struct Flag(pub bool);

/// A string.
pub(super) struct Text(pub String);

/// A list of strings.
pub(super) struct Texts(pub Vec<String>);

/// A whole number from `MIN` to `MAX`.
pub(super) struct Whole<const MIN: i64, const MAX: i64>(pub i64);

/// A number in `B`'s range ([`crate::limits`]); a whole number is read as one.
pub(super) struct Number<B>(pub f64, PhantomData<B>);

/// Which range a [`Number`] takes.
pub(super) trait Bounds {
    const RANGE: Range;
}

/// A spending cap.
pub(super) struct Cost;
/// A price per million tokens.
pub(super) struct Price;
pub(super) struct Temperature;
pub(super) struct TopP;

impl Bounds for Cost {
    const RANGE: Range = limits::COST_USD;
}
impl Bounds for Price {
    const RANGE: Range = limits::PRICE_PER_MILLION;
}
impl Bounds for Temperature {
    const RANGE: Range = limits::TEMPERATURE;
}
impl Bounds for TopP {
    const RANGE: Range = limits::TOP_P;
}

/// The `[[worker]]` tables, unread.
pub(super) struct WorkerList(pub Vec<toml::Value>);

/// Reads a value as TOML, then checks it with `check`, whose error is the message.
fn checked<'de, D: Deserializer<'de>, T>(
    deserializer: D,
    check: impl FnOnce(toml::Value) -> Result<T, String>,
) -> Result<T, D::Error> {
    check(toml::Value::deserialize(deserializer)?).map_err(de::Error::custom)
}

fn wrong_type(want: &str, got: &toml::Value) -> String {
    format!("expected {want}, found {} `{got}`", got.type_str())
}

impl<'de> Deserialize<'de> for Flag {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        checked(deserializer, |v| match v {
            toml::Value::Boolean(b) => Ok(Flag(b)),
            v => Err(wrong_type("true or false", &v)),
        })
    }
}

impl<'de> Deserialize<'de> for Text {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        checked(deserializer, |v| match v {
            toml::Value::String(s) => Ok(Text(s)),
            v => Err(wrong_type("a string", &v)),
        })
    }
}

impl<'de> Deserialize<'de> for Texts {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        checked(deserializer, |v| match v {
            toml::Value::Array(items) => items
                .into_iter()
                .map(|v| match v {
                    toml::Value::String(s) => Ok(s),
                    v => Err(wrong_type("a list of strings", &v)),
                })
                .collect::<Result<_, _>>()
                .map(Texts),
            v => Err(wrong_type("a list of strings", &v)),
        })
    }
}

impl<'de, const MIN: i64, const MAX: i64> Deserialize<'de> for Whole<MIN, MAX> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        checked(deserializer, |v| match v {
            toml::Value::Integer(n) if (MIN..=MAX).contains(&n) => Ok(Whole(n)),
            toml::Value::Integer(n) => Err(format!("{n} is out of range ({} to {})", MIN, MAX)),
            v => Err(wrong_type("a whole number", &v)),
        })
    }
}

impl<'de, B: Bounds> Deserialize<'de> for Number<B> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        checked(deserializer, |v| {
            let value = match v {
                toml::Value::Float(f) => f,
                toml::Value::Integer(n) => n as f64,
                v => return Err(wrong_type("a number", &v)),
            };
            // The key is named by the table's error; the message says the range.
            B::RANGE
                .check("it", value)
                .map(|n| Number(n, PhantomData))
                .map_err(|_| format!("{value} is out of range: it must be {}", B::RANGE))
        })
    }
}

impl<'de> Deserialize<'de> for WorkerList {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        checked(deserializer, |v| match v {
            toml::Value::Array(items) => Ok(WorkerList(items)),
            _ => Err("must be an array of tables: write [[worker]]".to_owned()),
        })
    }
}

/// What is wrong with a table: the field, as a dotted path below the table read (empty when
/// the mistake is the value handed in itself), and the message.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub(super) struct FieldError {
    pub field: String,
    pub message: String,
}

impl FieldError {
    /// The same mistake, seen from the table that holds it under `key`.
    fn under(mut self, key: &str) -> FieldError {
        self.field = if self.field.is_empty() { key.to_owned() } else { format!("{key}.{}", self.field) };
        self
    }
}

impl de::Error for FieldError {
    fn custom<T: fmt::Display>(message: T) -> Self {
        FieldError { field: String::new(), message: message.to_string() }
    }
}

/// Reads `table` as a `T`; a key `T` does not have is refused as `unknown` ("unknown setting"
/// at the top of the file, "unknown field" in a table), with the keys it could be.
pub(super) fn read<T: DeserializeOwned>(table: &toml::Table, unknown: &'static str) -> Result<T, FieldError> {
    T::deserialize(TableDe { table, unknown })
}

/// A table, read entry by entry so that an error in a value is put under its key.
struct TableDe<'a> {
    table: &'a toml::Table,
    unknown: &'static str,
}

impl<'de> Deserializer<'de> for TableDe<'_> {
    type Error = FieldError;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, FieldError> {
        visitor.visit_map(Entries { entries: self.table.iter(), value: None })
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, FieldError> {
        // Checked before any value, so a misspelt key is named as such, not as a missing value.
        if let Some(key) = self.table.keys().find(|k| !fields.contains(&k.as_str())) {
            return Err(FieldError {
                field: key.clone(),
                message: format!("{}; expected one of {}", self.unknown, fields.join(", ")),
            });
        }
        self.deserialize_any(visitor)
    }

    forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf option unit
        unit_struct newtype_struct seq tuple tuple_struct map enum identifier ignored_any
    }
}

struct Entries<'a> {
    entries: toml::map::Iter<'a, String, toml::Value>,
    /// The entry whose key serde read last, for its value.
    value: Option<(&'a str, &'a toml::Value)>,
}

impl<'de> MapAccess<'de> for Entries<'_> {
    type Error = FieldError;

    fn next_key_seed<K: DeserializeSeed<'de>>(&mut self, seed: K) -> Result<Option<K::Value>, FieldError> {
        let Some((key, value)) = self.entries.next() else {
            return Ok(None);
        };
        self.value = Some((key.as_str(), value));
        seed.deserialize(de::value::StrDeserializer::<FieldError>::new(key)).map(Some)
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, FieldError> {
        let (key, value) = self.value.take().expect("serde reads a key before its value");
        seed.deserialize(ValueDe(value)).map_err(|e| e.under(key))
    }
}

/// A value in a table: a table read as a struct is read as [`TableDe`] reads one; any other
/// value as TOML's own deserializer reads it.
struct ValueDe<'a>(&'a toml::Value);

impl<'de> Deserializer<'de> for ValueDe<'_> {
    type Error = FieldError;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, FieldError> {
        self.0.clone().deserialize_any(visitor).map_err(|e| de::Error::custom(e.message()))
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, FieldError> {
        // TOML has no null: a key that is there has a value.
        visitor.visit_some(self)
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, FieldError> {
        match self.0 {
            toml::Value::Table(table) => {
                TableDe { table, unknown: "unknown field" }.deserialize_struct(name, fields, visitor)
            }
            v => Err(de::Error::custom(wrong_type("a table", v))),
        }
    }

    forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf unit
        unit_struct newtype_struct seq tuple tuple_struct map enum identifier ignored_any
    }
}
