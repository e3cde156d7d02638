//! The normalized plan: what every consumer (executor, store, UI) works with.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::{List, PlanError};

/// The paper's default cap on workflow length.
pub const DEFAULT_MAX_STEPS: usize = 5;

/// The version of the plan's JSON shape that `baton plan --json` and `baton plan parse` print
/// (`{"version":1,"model_id":[…],…}`, see docs/json.md). Reading accepts it, or no version at
/// all (the plan's own serde form, as the history and events carry it), and refuses any other.
pub const JSON_VERSION: u32 = 1;

/// A workflow: the conductor's three lists, zipped into steps.
///
/// Serializes as the three lists (`{"model_id":[…],"subtasks":[…],"access_list":[…]}`), the
/// stable JSON shape of `baton plan parse` (which adds `"version"`: [`JSON_VERSION`]).
#[derive(Debug, Clone, PartialEq, Eq, Default, ts_rs::TS)]
#[ts(type = "{ model_id: Array<number>, subtasks: Array<string>, access_list: Array<Access> }")]
pub struct Plan {
    pub steps: Vec<Step>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    /// Index of the worker in the pool ("Model N" to the conductor).
    pub model_id: usize,
    /// The instruction the worker receives as its last user turn.
    pub subtask: String,
    /// Which earlier steps' subtask and answer the worker sees.
    pub access: Access,
}

/// Which earlier steps a step sees.
#[derive(Debug, Clone, PartialEq, Eq, ts_rs::TS)]
#[ts(type = "\"all\" | Array<number>")]
pub enum Access {
    /// Every earlier step (`"all"`).
    All,
    /// Exactly these earlier steps, sorted and without duplicates (`[]` sees nothing).
    Steps(Vec<usize>),
}

impl Access {
    /// Builds a step list in normal form: sorted, duplicates removed.
    pub fn steps(mut indices: Vec<usize>) -> Self {
        indices.sort_unstable();
        indices.dedup();
        Access::Steps(indices)
    }

    /// The earlier steps that step `index` sees, in step order.
    pub fn resolve(&self, index: usize) -> Vec<usize> {
        match self {
            Access::All => (0..index).collect(),
            Access::Steps(steps) => steps.clone(),
        }
    }
}

/// What a plan is checked against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_steps: usize,
    /// Number of workers in the pool; `None` skips the model id range check.
    pub pool_size: Option<usize>,
    /// Whether three empty lists ("stop") are acceptable.
    pub allow_stop: bool,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_steps: DEFAULT_MAX_STEPS, pool_size: None, allow_stop: true }
    }
}

impl Plan {
    /// Three empty lists: the conductor's way of saying the work is done.
    pub fn is_stop(&self) -> bool {
        self.steps.is_empty()
    }

    /// Checks the plan against `limits`. The first problem found is reported.
    pub fn validate(&self, limits: &Limits) -> Result<(), PlanError> {
        let n = self.steps.len();
        if n == 0 && !limits.allow_stop {
            return Err(PlanError::invalid(None, None, "the plan has no steps"));
        }
        if n > limits.max_steps {
            return Err(PlanError::invalid(
                None,
                None,
                format!("the plan has {n} steps; at most {} are allowed", limits.max_steps),
            ));
        }
        for (i, step) in self.steps.iter().enumerate() {
            if let Some(pool) = limits.pool_size
                && step.model_id >= pool
            {
                let range = if pool == 0 {
                    "the pool is empty".to_owned()
                } else {
                    format!("the pool has {pool} worker{} (0..={})", if pool == 1 { "" } else { "s" }, pool - 1)
                };
                return Err(PlanError::invalid(
                    Some(List::ModelId),
                    Some(i),
                    format!("model {} is not in the pool; {range}", step.model_id),
                ));
            }
            if step.subtask.trim().is_empty() {
                return Err(PlanError::invalid(Some(List::Subtasks), Some(i), "the subtask is empty"));
            }
            if let Access::Steps(seen) = &step.access {
                for &j in seen {
                    if j == i {
                        return Err(PlanError::invalid(
                            Some(List::AccessList),
                            Some(i),
                            format!("step {i} cannot see its own output; a step sees only earlier steps"),
                        ));
                    }
                    if j > i {
                        return Err(PlanError::invalid(
                            Some(List::AccessList),
                            Some(i),
                            format!("step {j} comes after step {i}; a step sees only earlier steps"),
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// The steps each step waits for (its resolved access list).
    pub fn dependencies(&self) -> Vec<Vec<usize>> {
        self.steps.iter().enumerate().map(|(i, s)| s.access.resolve(i)).collect()
    }

    /// Prints the plan in the conductor's format; `parse` reads it back unchanged.
    pub fn to_python(&self) -> String {
        let ids: Vec<String> = self.steps.iter().map(|s| s.model_id.to_string()).collect();
        let subtasks: Vec<String> = self.steps.iter().map(|s| python_str(&s.subtask)).collect();
        let access: Vec<String> = self
            .steps
            .iter()
            .map(|s| match &s.access {
                Access::All => "\"all\"".to_owned(),
                Access::Steps(v) => {
                    format!("[{}]", v.iter().map(ToString::to_string).collect::<Vec<_>>().join(", "))
                }
            })
            .collect();
        format!(
            "model_id = [{}]\nsubtasks = [{}]\naccess_list = [{}]\n",
            ids.join(", "),
            subtasks.join(", "),
            access.join(", ")
        )
    }

    /// The normalized JSON object of `baton plan parse`.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|_| unreachable!("plans always serialize"))
    }
}

/// A Python double-quoted string literal for `s`.
fn python_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 || c == '\u{7f}' => out.push_str(&format!("\\x{:02x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_python())
    }
}

/// The wire shape: three parallel lists.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Lists {
    /// Present in what the command line prints; a plan never writes it itself, so that stored
    /// plans and events keep their shape.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    version: Option<u32>,
    model_id: Vec<usize>,
    subtasks: Vec<String>,
    access_list: Vec<Access>,
}

impl Serialize for Plan {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        Lists {
            version: None,
            model_id: self.steps.iter().map(|s| s.model_id).collect(),
            subtasks: self.steps.iter().map(|s| s.subtask.clone()).collect(),
            access_list: self.steps.iter().map(|s| s.access.clone()).collect(),
        }
        .serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Plan {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let lists = Lists::deserialize(deserializer)?;
        match lists.version {
            None | Some(JSON_VERSION) => {}
            Some(v) if v > JSON_VERSION => {
                return Err(serde::de::Error::custom(format!(
                    "the plan is JSON version {v}, newer than this Baton reads (version {JSON_VERSION}): upgrade Baton"
                )));
            }
            Some(v) => {
                return Err(serde::de::Error::custom(format!(
                    "the plan's JSON version {v} does not exist (versions start at 1)"
                )));
            }
        }
        let (a, b, c) = (lists.model_id.len(), lists.subtasks.len(), lists.access_list.len());
        if a != b || b != c {
            return Err(serde::de::Error::custom(format!(
                "the three lists differ in length: model_id has {a}, subtasks {b}, access_list {c}"
            )));
        }
        let steps = lists
            .model_id
            .into_iter()
            .zip(lists.subtasks)
            .zip(lists.access_list)
            .map(|((model_id, subtask), access)| Step { model_id, subtask, access })
            .collect();
        Ok(Plan { steps })
    }
}

impl Serialize for Access {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Access::All => serializer.serialize_str("all"),
            Access::Steps(v) => v.serialize(serializer),
        }
    }
}

impl<'de> Deserialize<'de> for Access {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Repr {
            Word(String),
            Steps(Vec<usize>),
        }
        match Repr::deserialize(deserializer)? {
            Repr::Word(w) if w == "all" => Ok(Access::All),
            Repr::Word(w) => {
                Err(serde::de::Error::custom(format!("access entry {w:?}: expected \"all\" or a list of step numbers")))
            }
            Repr::Steps(v) => Ok(Access::steps(v)),
        }
    }
}
