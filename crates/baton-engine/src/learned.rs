//! What a pool learned of its workers, as a run uses it: which worker to choose for a kind of
//! question, whether it answers without a plan, what the conductor is told of each worker, and
//! the plans that were right. It comes from the history's learning runs (`baton pool learn`,
//! drawn from the profiles by [`crate::profile::measure`]), never from the pool file: a pool
//! holds it beside its options, as [`crate::Pool::learned`].

use std::collections::BTreeMap;

use crate::workflow::Workflow;

/// What the pool learned of its workers alone: the best one overall, the choices per category
/// and per kind, and the category of each question it learned from, so a new question can be
/// placed by the learned questions nearest to it. From the history, never from the pool file
/// (see the module's comment).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Measured {
    /// The best worker alone over every test item.
    pub best: Option<usize>,
    /// Per category (only categories with at least [`MIN_CATEGORY_ITEMS`] runs of every
    /// worker).
    pub by_category: Choices,
    /// Per kind (`number`, `choice`, `code`, `exact`) over every category, for a question no
    /// category places.
    pub by_kind: Choices,
    /// Each learned question with its category.
    pub questions: Vec<(String, String)>,
    /// Worker → what it did alone per category when the pool learned, in words, for the
    /// conductor's prompt (workers with a current profile only).
    pub strengths: BTreeMap<usize, String>,
    /// Plans the conductor wrote while the pool learned whose answers were right, their
    /// workers renumbered into this pool (plans naming a worker that changed since are left
    /// out); the conductor's examples for similar questions.
    pub plans: Vec<LearnedPlan>,
}

/// What the profiles choose for each category (or each kind) of question: its worker, and
/// whether that worker answers without a plan and why.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Choices {
    /// Key → the cheapest worker alone as good as the best on its items.
    pub best: BTreeMap<String, usize>,
    /// Key → why its worker may answer without a plan: its choice is clear (its interval above
    /// every worker that is not as good).
    pub clear: BTreeMap<String, String>,
    /// Key → why its worker answers without a plan though its choice is not clear: the
    /// conductor's plans were measured, and not shown to do better than that worker alone
    /// ([`crate::profile::weigh_plans`]).
    pub no_gain: BTreeMap<String, String>,
    /// Key → a learned workflow that was right more often than every worker alone by a clear
    /// margin ([`crate::profile::weigh_workflows`]): it answers without a plan, ahead of any
    /// worker alone.
    pub flows: BTreeMap<String, FlowChoice>,
}

impl Choices {
    /// Why `key`'s worker answers alone, without a plan; `None` where a plan is written.
    pub fn alone(&self, key: &str) -> Option<&String> {
        self.clear.get(key).or_else(|| self.no_gain.get(key))
    }
}

/// The workflow a kind of question goes to, and why.
#[derive(Debug, Clone, PartialEq)]
pub struct FlowChoice {
    pub workflow: Workflow,
    /// In words: "reader, then calc seeing reader's answer was right on 12 of 12 …".
    pub why: String,
}

/// A plan the conductor wrote while the pool learned, whose answer was right: an example it
/// is shown for similar questions, so it plans from what worked in this pool.
#[derive(Debug, Clone, PartialEq)]
pub struct LearnedPlan {
    pub question: String,
    /// The learning item's category.
    pub category: String,
    /// Its steps, on this pool's workers.
    pub plan: baton_plan::Plan,
    /// What the run cost (and how many calls it made): of two plans that were right for
    /// similar questions, the cheaper one is shown.
    pub cost_usd: f64,
    pub calls: u64,
}

/// The fewest items a category needs before its own best worker is trusted over the best
/// overall.
pub const MIN_CATEGORY_ITEMS: usize = 4;
