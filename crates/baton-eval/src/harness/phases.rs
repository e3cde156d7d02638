//! The phases of an evaluation (the order of work in the module doc): what each one runs, and
//! the choices each one makes and saves with the config so that a resume makes the same ones.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use tokio_util::sync::CancellationToken;

use super::derived::{derive, lookup_table, matched_n};
use super::items::{select, split};
use super::jobs::{not_done, run_jobs};
use super::run_one::{Job, Purse, Run, RunCtx};
use super::{Config, Ended, EvalError, Harness, Progress, Spec};
use crate::sandbox::Sandbox;
use crate::strategy::Strategy;

/// One evaluation under way: what its phases share.
pub(super) struct Evaluation<'a> {
    pub(super) harness: &'a Harness,
    pub(super) spec: &'a Spec,
    /// The settings, and the choices made so far (saved as they are made).
    pub(super) config: Config,
    pub(super) ctx: Arc<RunCtx<'a>>,
    /// (strategy, item, repeat) of the results recorded before this call: a resume pays for
    /// nothing twice.
    done: HashSet<(String, String, u32)>,
    /// The calibration split, as indices into the items.
    calibration_items: Vec<usize>,
    /// The test split, as indices into the items.
    pub(super) test_items: Vec<usize>,
    /// The strategies that are run (the others are derived from their results).
    runnable: Vec<&'a Strategy>,
    /// The workers that run alone on the test split, in pool order: every one when a router or
    /// the oracle is derived from them, else those asked for.
    singles: Vec<usize>,
    cancel: &'a CancellationToken,
}

impl<'a> Evaluation<'a> {
    /// Draws the items and their splits and reads what was done before.
    pub(super) async fn start(
        harness: &'a Harness,
        spec: &'a Spec,
        config: Config,
        sandbox: Option<Arc<Sandbox>>,
        spent_before: f64,
        progress: &'a (dyn Fn(Progress) + Send + Sync),
        cancel: &'a CancellationToken,
    ) -> Result<Evaluation<'a>, EvalError> {
        let items = select(&spec.suite.items, spec.limit, spec.seed);
        let is_calibration = split(&items, config.calibration, spec.seed);
        let recorded = harness.store.eval_results(&spec.id).await?;
        let done: HashSet<(String, String, u32)> =
            recorded.into_iter().map(|r| (r.strategy, r.item_id, r.repeat)).collect();
        let singles: Vec<usize> = (0..harness.workers.len())
            .filter(|&w| {
                spec.strategies.iter().any(|s| s.is_derived())
                    || spec.strategies.contains(&Strategy::Single(harness.workers[w].clone()))
            })
            .collect();
        let test_items: Vec<usize> = (0..items.len()).filter(|i| !is_calibration[*i]).collect();
        let calibration_items: Vec<usize> = (0..items.len()).filter(|i| is_calibration[*i]).collect();
        let ctx = Arc::new(RunCtx {
            harness: harness.clone(),
            id: spec.id.clone(),
            items,
            sandbox,
            purse: Mutex::new(Purse { cap: spec.max_cost_usd, spent: spent_before, promised: 0.0, over: false }),
            progress,
        });
        Ok(Evaluation {
            harness,
            spec,
            config,
            ctx,
            done,
            calibration_items,
            test_items,
            runnable: spec.strategies.iter().filter(|s| !s.is_derived()).collect(),
            singles,
            cancel,
        })
    }

    fn single_key(&self, w: usize) -> String {
        Strategy::Single(self.harness.workers[w].clone()).key()
    }

    /// Phase 1: every worker alone on the calibration split (nothing when its share is 0).
    pub(super) fn calibration_jobs(&self) -> Vec<Job> {
        let mut jobs = Vec::new();
        if self.config.calibration > 0.0 {
            for w in 0..self.harness.workers.len() {
                for &i in &self.calibration_items {
                    for r in 0..self.config.repeats {
                        jobs.push(Job {
                            strategy: self.single_key(w),
                            what: Run::Single(w),
                            item: i,
                            repeat: r,
                            calibration: true,
                        });
                    }
                }
            }
        }
        jobs
    }

    /// Tells the bar everything that will run (best-of-n counted at its eventual size), and how
    /// much of it was done before.
    pub(super) fn announce_plan(&self, calibration_jobs: &[Job]) {
        let items = &self.ctx.items;
        let per_item: usize = self
            .runnable
            .iter()
            .filter(|s| !matches!(s, Strategy::Single(_)))
            .map(|s| self.config.repeats_of(s) as usize)
            .sum::<usize>()
            + self.singles.len() * self.config.repeats as usize;
        let total = calibration_jobs.len() + per_item * self.test_items.len();
        let calibrated = calibration_jobs
            .iter()
            .filter(|j| self.done.contains(&(j.strategy.clone(), items[j.item].id.clone(), j.repeat)))
            .count();
        // Derived rows are left out: they are not runs, and `total` does not count them.
        let tested = self
            .done
            .iter()
            .filter(|(s, item, _)| {
                !s.starts_with("router:") && s != "oracle" && self.test_items.iter().any(|&t| items[t].id == *item)
            })
            .count();
        (self.ctx.progress)(Progress::Planned { total, done: (calibrated + tested).min(total) });
    }

    /// Runs those of `jobs` whose results are not recorded yet. `Some(end)` when stopped early.
    pub(super) async fn run_remaining(&self, jobs: Vec<Job>) -> Result<Option<Ended>, EvalError> {
        let jobs = not_done(jobs, &self.done, &self.ctx.items);
        run_jobs(&self.ctx, jobs, self.spec.concurrency, self.cancel).await
    }

    /// Phase 2: the lookup router's table and MoA's aggregator, from the calibration results
    /// (once: a resume keeps the choices made before).
    pub(super) async fn choose_lookup_and_aggregator(&mut self) -> Result<(), EvalError> {
        let workers = &self.harness.workers;
        let results = self.harness.store.eval_results(&self.spec.id).await?;
        if self.config.calibration > 0.0 && self.config.lookup.is_empty() {
            let (table, best) = lookup_table(&results, workers, &self.ctx.items);
            self.config.lookup = table;
            if self.config.moa_aggregator.is_none() {
                self.config.moa_aggregator = best;
            }
            if !self.config.lookup.is_empty() {
                let shown: Vec<String> = self.config.lookup.iter().map(|(c, w)| format!("{c} → {w}")).collect();
                (self.ctx.progress)(Progress::Note(format!(
                    "lookup table from the calibration split: {}",
                    shown.join(", ")
                )));
            }
        }
        if self.config.moa_aggregator.is_none() {
            self.config.moa_aggregator = workers.first().cloned();
        }
        self.save_config().await
    }

    /// MoA's aggregator (chosen in phase 2) as an index into the pool.
    fn aggregator(&self) -> usize {
        self.config.moa_aggregator.as_ref().and_then(|a| self.harness.workers.iter().position(|w| w == a)).unwrap_or(0)
    }

    /// Phase 3: the test split: the conductor, MoA and the single workers.
    pub(super) fn test_jobs(&self) -> Vec<Job> {
        let aggregator = self.aggregator();
        let mut jobs = Vec::new();
        for &i in &self.test_items {
            for s in &self.runnable {
                let what = match s {
                    Strategy::Conductor => Run::Conductor,
                    Strategy::Moa => Run::Moa { aggregator },
                    _ => continue,
                };
                for r in 0..self.config.repeats_of(s) {
                    jobs.push(Job { strategy: s.key(), what: what.clone(), item: i, repeat: r, calibration: false });
                }
            }
            for r in 0..self.config.repeats {
                for &w in &self.singles {
                    jobs.push(Job {
                        strategy: self.single_key(w),
                        what: Run::Single(w),
                        item: i,
                        repeat: r,
                        calibration: false,
                    });
                }
            }
        }
        jobs
    }

    /// Phase 4: best-of-n on the test split, `n` matched to the conductor's cost per item when
    /// not given (and kept for a resume); never more samples than the pool's `max_steps`.
    pub(super) async fn best_of_n_jobs(&mut self) -> Result<Vec<Job>, EvalError> {
        let harness = self.harness;
        let results = harness.store.eval_results(&self.spec.id).await?;
        let max_steps = harness.executor.options().max_steps.max(1) as u32;
        let mut jobs = Vec::new();
        for s in self.runnable.clone() {
            let Strategy::BestOfN { worker, n } = s else { continue };
            let w = harness.workers.iter().position(|x| x == worker).unwrap_or(0);
            let n = match (n, self.config.best_of_n.get(worker)) {
                (Some(n), _) => *n,
                (None, Some(n)) => *n,
                (None, None) => {
                    let n = matched_n(&results, &self.single_key(w)).clamp(1, max_steps);
                    (self.ctx.progress)(Progress::Note(format!(
                        "best-of-n:{worker}: n = {n}, to match the conductor's cost per item (at most the pool's max_steps, {max_steps})"
                    )));
                    n
                }
            }
            .clamp(1, max_steps);
            self.config.best_of_n.insert(worker.clone(), n);
            for &i in &self.test_items {
                for r in 0..self.config.repeats {
                    jobs.push(Job {
                        strategy: s.key(),
                        what: Run::BestOfN { worker: w, n },
                        item: i,
                        repeat: r,
                        calibration: false,
                    });
                }
            }
        }
        self.save_config().await?;
        Ok(jobs)
    }

    /// Phase 5: the routers' and the oracle's rows, from the single workers' test results.
    pub(super) async fn derive_routers_and_oracle(&self) -> Result<(), EvalError> {
        let store = &self.harness.store;
        let results = store.eval_results(&self.spec.id).await?;
        for s in self.spec.strategies.iter().filter(|s| s.is_derived()) {
            // A category the calibration split had no items of goes to the best worker overall.
            let fallback = self.aggregator();
            let rows = derive(
                s,
                &results,
                &self.harness.workers,
                &self.ctx.items,
                &self.test_items,
                self.config.repeats,
                &self.config.lookup,
                fallback,
                self.spec.seed,
            );
            for row in rows {
                store.put_eval_result(&self.spec.id, &row).await?;
            }
        }
        Ok(())
    }

    pub(super) async fn save_config(&self) -> Result<(), EvalError> {
        let json = serde_json::to_value(&self.config).unwrap_or_default();
        self.harness.store.update_evaluation(&self.spec.id, &json, "running").await?;
        Ok(())
    }

    /// Records how the evaluation ended, with the choices made so far; returns `end`.
    pub(super) async fn finish(&self, end: Ended) -> Result<Ended, EvalError> {
        let json = serde_json::to_value(&self.config).unwrap_or_default();
        self.harness.store.update_evaluation(&self.spec.id, &json, end.as_str()).await?;
        Ok(end)
    }
}
