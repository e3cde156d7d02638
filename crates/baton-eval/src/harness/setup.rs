//! Before any run: the settings checked, the sandbox opened where code is scored, and the
//! evaluation created, or resumed when its stored settings are these.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::items::pinned_share;
use super::{Config, EvalError, Harness, Progress, Purpose, Spec};
use crate::sandbox::Sandbox;
use crate::strategy::Strategy;
use crate::suite::Kind;

impl Harness {
    /// `spec` without the items the pool learned from (see [`Purpose::Evaluate`]),
    /// said in a note; refused when nothing is left.
    pub(super) fn leaving_out_what_was_learned(
        &self,
        spec: &Spec,
        progress: &(dyn Fn(Progress) + Send + Sync),
    ) -> Result<Spec, EvalError> {
        let Purpose::Evaluate { leave_out: learned } = &spec.purpose else { return Ok(spec.clone()) };
        let questions: std::collections::HashSet<&str> = learned.questions.iter().map(|q| q.trim()).collect();
        let suite = &spec.suite.sha256;
        let mut kept = spec.clone();
        // By id within the suite learned from; by text for the same question in another file
        // (the history keeps each question as the item's prompt was sent).
        kept.suite.items.retain(|i| {
            !learned.items.contains(&(suite.clone(), i.id.clone()))
                && !questions.contains(i.question.trim())
                && !questions.contains(super::prompt(i).trim())
        });
        let left_out = spec.suite.items.len() - kept.suite.items.len();
        if left_out > 0 && kept.suite.items.is_empty() {
            return Err(EvalError::Settings(format!(
                "every item of {} is a question this pool learned from (`baton pool learn`); evaluate it on other items",
                spec.suite.name
            )));
        }
        if left_out > 0 {
            progress(Progress::Note(format!(
                "{left_out} of {}'s {} items are questions this pool learned from; they are left out, so the pool is scored only on what it was not taught with",
                spec.suite.name,
                spec.suite.items.len()
            )));
        }
        Ok(kept)
    }

    /// The share of items kept for calibration, with the settings that cannot run refused.
    pub(super) fn calibration_share(&self, spec: &Spec) -> Result<f64, EvalError> {
        let needs_calibration = spec.strategies.iter().any(|s| matches!(s, Strategy::RouterLookup | Strategy::Moa));
        let pinned = pinned_share(&spec.suite.items);
        if pinned.is_some() && spec.calibration.is_some() {
            return Err(EvalError::Settings(
                "the suite's items say which split they are in (`split`); leave out --calibration".into(),
            ));
        }
        // Pinned calibration items run only when a strategy learns from them; either way they
        // are never test items (`split` honours the pins whatever the fraction).
        let calibration = match pinned {
            Some(share) if needs_calibration => share,
            Some(_) => 0.0,
            None => spec.calibration.unwrap_or(if needs_calibration { 0.3 } else { 0.0 }),
        };
        if !(0.0..0.9).contains(&calibration) {
            return Err(EvalError::Settings("--calibration must be at least 0 and below 0.9".into()));
        }
        if calibration == 0.0 && spec.strategies.contains(&Strategy::RouterLookup) {
            return Err(EvalError::Settings(
                "router:lookup learns from a calibration split: give --calibration above 0".into(),
            ));
        }
        if spec.strategies.contains(&Strategy::Conductor) && !self.has_conductor {
            return Err(EvalError::Settings(
                "the conductor strategy needs a conductor: set [conductor] in the pool or pass --conductor".into(),
            ));
        }
        Ok(calibration)
    }

    /// The evaluation's config, and what it has spent before: stored new, or read back (with
    /// the choices made along the way) when `spec.id` was started with the same settings.
    pub(super) async fn create_or_resume(&self, spec: &Spec, calibration: f64) -> Result<(Config, f64), EvalError> {
        let mut config = Config {
            strategies: spec.strategies.iter().map(ToString::to_string).collect(),
            repeats: spec.repeats.max(1),
            calibration,
            limit: spec.limit,
            seed: spec.seed,
            workers: self.workers.clone(),
            suite_source: Some(spec.suite_source.clone()),
            best_of_n: BTreeMap::new(),
            moa_aggregator: None,
            lookup: BTreeMap::new(),
            max_cost_usd: spec.max_cost_usd,
            learn: matches!(spec.purpose, Purpose::Learn { .. }),
            identities: match &spec.purpose {
                Purpose::Learn { identities, .. } => identities.clone(),
                _ => Vec::new(),
            },
            plan_samples: match &spec.purpose {
                Purpose::Learn { plan_samples, .. } => *plan_samples,
                _ => 0,
            },
            conductor: match &spec.purpose {
                Purpose::Learn { conductor, .. } => conductor.clone(),
                _ => None,
            },
            search: matches!(spec.purpose, Purpose::Learn { search: true, .. }),
            workflows: BTreeMap::new(),
        };
        let spent_before = match self.store.evaluation(&spec.id).await? {
            Some(existing) => {
                if existing.suite_sha256 != spec.suite.sha256 {
                    return Err(EvalError::Settings(format!(
                        "evaluation {} was run on other items ({}); choose another --id",
                        spec.id, existing.suite
                    )));
                }
                let before: Config = serde_json::from_value(existing.config.clone()).map_err(|e| {
                    EvalError::Settings(format!("evaluation {} has an unreadable config: {e}", spec.id))
                })?;
                if !before.same_settings(&config) {
                    return Err(EvalError::Settings(format!(
                        "evaluation {} was started with other settings (strategies {}, repeats {}, calibration {}, limit {:?}, seed {}, workers {}); run it with those, or choose another --id",
                        spec.id,
                        before.strategies.join(","),
                        before.repeats,
                        before.calibration,
                        before.limit,
                        before.seed,
                        before.workers.join(",")
                    )));
                }
                config.best_of_n = before.best_of_n;
                config.moa_aggregator = before.moa_aggregator;
                config.lookup = before.lookup;
                config.workflows = before.workflows;
                existing.spent_usd
            }
            None => {
                let json = serde_json::to_value(&config).unwrap_or_default();
                self.store.create_evaluation(&spec.id, &spec.suite.name, &spec.suite.sha256, &json).await?;
                0.0
            }
        };
        Ok((config, spent_before))
    }
}

/// The sandbox code items are scored in, when the suite has any (said to the user, with how
/// it isolates them).
pub(super) fn sandbox(
    spec: &Spec,
    progress: &(dyn Fn(Progress) + Send + Sync),
) -> Result<Option<Arc<Sandbox>>, EvalError> {
    Ok(if spec.suite.items.iter().any(|i| i.kind == Kind::Code) {
        let s = Sandbox::new(crate::sandbox::Limits::default())?;
        progress(Progress::Note(format!("code runs in a sandbox: {}", s.isolation.describe())));
        Some(Arc::new(s))
    } else {
        None
    })
}
