//! The conductor's workflow format.
//!
//! A conductor answers in free text that ends with three Python lists:
//!
//! ```text
//! model_id = [2, 0, 1]
//! subtasks = ["Solve ...", 'Check the solution above ...', """Write the final ..."""]
//! access_list = [[], "all", [0, 1]]
//! ```
//!
//! [`parse`] finds them, reads them with Python literal syntax, and validates the result into a
//! [`Plan`]; it also reads the JSON object `baton plan --json` prints, so that a plan printed can
//! be given back. [`Plan::to_python`] prints a plan back in the same format and [`Plan`]'s serde
//! form is the three lists as JSON.

mod literal;
mod parse;
mod plan;

use std::fmt;

pub use parse::parse;
pub use plan::{Access, DEFAULT_MAX_STEPS, JSON_VERSION, Limits, Plan, Step};

/// One of the three lists of a plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum List {
    ModelId = 0,
    Subtasks = 1,
    AccessList = 2,
}

impl List {
    pub const ALL: [List; 3] = [List::ModelId, List::Subtasks, List::AccessList];

    pub fn name(self) -> &'static str {
        match self {
            List::ModelId => "model_id",
            List::Subtasks => "subtasks",
            List::AccessList => "access_list",
        }
    }
}

/// A 1-based line and column (in characters) in the conductor's text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pos {
    pub line: usize,
    pub column: usize,
}

impl fmt::Display for Pos {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}, column {}", self.line, self.column)
    }
}

/// Why a text is not a usable plan. The message names the list, the step and the position
/// wherever they are known.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error(
        "no plan found: expected three assignments `model_id = [...]`, `subtasks = [...]` and `access_list = [...]`"
    )]
    NotFound,
    #[error("incomplete plan: found {found} but no {missing}")]
    Incomplete { found: String, missing: String },
    #[error("{pos}: in `{}`: {message}", list.name())]
    Syntax { list: List, pos: Pos, message: String },
    #[error("{}", format_invalid(pos, list, step, message))]
    Invalid { pos: Option<Pos>, list: Option<List>, step: Option<usize>, message: String },
}

impl PlanError {
    pub(crate) fn invalid(list: Option<List>, step: Option<usize>, message: impl Into<String>) -> Self {
        PlanError::Invalid { pos: None, list, step, message: message.into() }
    }
}

fn format_invalid(pos: &Option<Pos>, list: &Option<List>, step: &Option<usize>, message: &str) -> String {
    let mut out = String::new();
    if let Some(pos) = pos {
        out.push_str(&format!("{pos}: "));
    }
    match (list, step) {
        (Some(list), Some(step)) => out.push_str(&format!("{}[{step}]: ", list.name())),
        (Some(list), None) => out.push_str(&format!("{}: ", list.name())),
        (None, Some(step)) => out.push_str(&format!("step {step}: ")),
        (None, None) => {}
    }
    out.push_str(message);
    out
}
