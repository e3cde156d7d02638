//! A learning run's search for workflows: for each item that no worker alone and no sampled
//! plan answered, the workflows of [`search_order`] in turn (every chain of two workers, then
//! one fan-out of the best), cheapest first, until one answers it; then each workflow that
//! answered something is run on the other items of its kind, so that its figures stand beside
//! the workers' on the same items and a route can be chosen by the same rule
//! ([`baton_engine::profile::weigh_workflows`]).
//!
//! Each round of the order runs as the evaluation's other jobs do (concurrently, within the
//! spending cap, each result kept as it arrives), and which items still need search is read
//! from the results before each round: a resume goes on where it stopped.

use std::collections::{BTreeMap, HashSet};

use baton_engine::workflow::{Workflow, search_bound, search_order};

use super::phases::Evaluation;
use super::run_one::{Job, Run};
use super::{Ended, EvalError, Progress};
use crate::strategy::Strategy;

/// How many workflows are measured on each kind of question: those that answered the most
/// searched items. More would each cost a run per item of the kind.
pub(super) const MEASURED_PER_KIND: usize = 2;

impl Evaluation<'_> {
    /// The search, for a learning run that asks for it. `Some(end)` when stopped early.
    pub(in crate::harness) async fn search(&mut self) -> Result<Option<Ended>, EvalError> {
        if !self.config.search {
            return Ok(None);
        }
        let workers = self.harness.workers.clone();
        let max_steps = self.harness.executor.options().max_steps;
        let store = &self.harness.store;
        let ranked = self.ranked(&store.eval_results(&self.spec.id).await?);
        let order = search_order(workers.len(), &ranked, max_steps);
        if order.is_empty() {
            return Ok(None);
        }
        let needing = self.unanswered(&store.eval_results(&self.spec.id).await?);
        if !needing.is_empty() {
            let (bound, _) = search_bound(workers.len());
            (self.ctx.progress)(Progress::Note(format!(
                "search: {} items that no worker alone and no plan answered; trying workflows, cheapest first ({bound}), \
                 then measuring each one that answers on the other items of its kind",
                needing.len()
            )));
        }
        for flow in &order {
            let needing = self.unanswered(&store.eval_results(&self.spec.id).await?);
            if needing.is_empty() {
                break;
            }
            let jobs = needing.into_iter().map(|item| self.job(flow, item)).collect();
            if let Some(end) = self.run_remaining(jobs).await? {
                return Ok(Some(end));
            }
        }
        self.measure_found(&order).await
    }

    /// Each workflow that answered a searched item (at most [`MEASURED_PER_KIND`] per kind, those
    /// that answered most) on every other item of its kind; recorded in the config, whose
    /// `workflows` the history reads.
    async fn measure_found(&mut self, order: &[Workflow]) -> Result<Option<Ended>, EvalError> {
        let results = self.harness.store.eval_results(&self.spec.id).await?;
        let items = &self.ctx.items;
        let workers = &self.harness.workers;
        // Kind → (searched items answered, place in the order, workflow).
        let mut found: BTreeMap<&str, Vec<(usize, usize, &Workflow)>> = BTreeMap::new();
        for (place, flow) in order.iter().enumerate() {
            let key = flow.key(workers);
            let mut per_kind: BTreeMap<&str, usize> = BTreeMap::new();
            for r in results.iter().filter(|r| r.strategy == key && r.correct) {
                if let Some(item) = items.iter().find(|i| i.id == r.item_id) {
                    *per_kind.entry(item.kind.as_str()).or_default() += 1;
                }
            }
            for (kind, right) in per_kind {
                found.entry(kind).or_default().push((right, place, flow));
            }
        }
        let mut jobs = Vec::new();
        for (kind, mut flows) in found {
            flows.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
            for (right, _, flow) in flows.into_iter().take(MEASURED_PER_KIND) {
                let key = flow.key(workers);
                if !self.config.workflows.contains_key(&key) {
                    (self.ctx.progress)(Progress::Note(format!(
                        "search found {} (right on {right} searched {kind} items): measuring it on every {kind} item",
                        flow.describe(workers)
                    )));
                }
                // `run_remaining` skips what was recorded before this call only: what search ran
                // since is left out here.
                let ran = |i: usize| results.iter().any(|r| r.strategy == key && r.item_id == items[i].id);
                let of_kind = self.test_items.iter().copied().filter(|&i| items[i].kind.as_str() == kind && !ran(i));
                jobs.extend(of_kind.map(|i| self.job(flow, i)));
                self.config.workflows.insert(key, flow.clone());
            }
        }
        self.save_config().await?;
        self.run_remaining(jobs).await
    }

    fn job(&self, flow: &Workflow, item: usize) -> Job {
        let strategy = flow.key(&self.harness.workers);
        Job { strategy, what: Run::Workflow(flow.clone()), item, repeat: 0, calibration: false }
    }

    /// The items of the test split that no result answered right (no worker alone, no plan,
    /// no workflow tried so far).
    fn unanswered(&self, results: &[baton_store::evaluations::EvalResult]) -> Vec<usize> {
        let right: HashSet<&str> = results.iter().filter(|r| r.correct).map(|r| r.item_id.as_str()).collect();
        self.test_items.iter().copied().filter(|&i| !right.contains(self.ctx.items[i].id.as_str())).collect()
    }

    /// The workers, best first by how many items each was right on alone in this run (pool
    /// order among equals): the fan-out's answerers and aggregator.
    fn ranked(&self, results: &[baton_store::evaluations::EvalResult]) -> Vec<usize> {
        let workers = &self.harness.workers;
        let right = |w: usize| {
            let key = Strategy::Single(workers[w].clone()).key();
            results.iter().filter(|r| r.strategy == key && r.correct).count()
        };
        let mut ranked: Vec<usize> = (0..workers.len()).collect();
        ranked.sort_by_key(|&w| std::cmp::Reverse(right(w)));
        ranked
    }
}
