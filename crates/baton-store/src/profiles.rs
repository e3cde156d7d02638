//! The workers' learned profiles, read from the history's learning runs (`baton pool learn`).
//!
//! A learning run is an evaluation whose config says `"learn": true` and lists, beside each
//! worker's name, the worker's [identity](baton_engine::WorkerSpec::identity) when it was
//! learned. Its results are kept as any evaluation's are, so the same rows serve the reports
//! and exports. A profile is found by identity, not by name: renaming a worker keeps its
//! profile, changing its model or settings makes it stale.

use std::collections::{BTreeMap, BTreeSet, HashSet};

use baton_engine::learned::LearnedPlan;
use baton_engine::profile::{CategoryFigures, ChatMarks, Freshness, Profile};
use baton_engine::workflow::Workflow;
use sqlx::Row;

use crate::{Store, StoreError};

/// What the pool learned: a profile per worker (in the pool's order), every learned question
/// with its category, by which a new question is placed, and the conductor's plans that were
/// right, the cheapest one per question.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Learned {
    pub profiles: Vec<Profile>,
    /// The conductor's sampled plans, scored as a worker's answers are (`worker` is
    /// [`PLANS`]): from the learning runs of this conductor over these very workers; `None`
    /// when none measured them.
    pub planned: Option<Profile>,
    pub questions: Vec<(String, String)>,
    pub plans: Vec<LearnedPlan>,
    /// The workflows search found (a learning run's config lists them under `workflows`, by
    /// their strategy key), renumbered into this pool, each with its figures as a profile
    /// (`worker` is its key in this pool): only those whose every worker is in the pool as it
    /// was learned, so a workflow goes stale with any of its workers.
    pub workflows: Vec<(Workflow, Profile)>,
    /// How varied the conductor's samples were, in the runs [`Learned::planned`] comes from.
    pub plan_variety: Option<baton_engine::profile::PlanVariety>,
}

/// The items a pool learned from ([`Store::learned_items`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LearnedItems {
    /// `(suite_sha256, item_id)`: each item by the suite file it came from and its id there.
    pub items: BTreeSet<(String, String)>,
    /// Their questions as they were sent: the same question in another suite file is left out
    /// by its text.
    pub questions: Vec<String>,
}

/// Whether a plan that answered right says what each step is for (its `subtasks`), and so is
/// worth showing as an example: every subtask has at least two words of letters, and no two steps have the same
/// one. A small conductor's plan can be right only because each worker was given the question
/// anyway, with subtasks such as ".1", a date, or one phrase five times; shown as an example,
/// such a plan is copied, and teaches nothing but its cost.
fn instructive(subtasks: &[&str]) -> bool {
    let says_something =
        |subtask: &str| subtask.split(|c: char| !c.is_alphabetic()).filter(|w| w.chars().count() >= 2).nth(1).is_some();
    let distinct: HashSet<&str> = subtasks.iter().map(|s| s.trim()).collect();
    distinct.len() == subtasks.len() && subtasks.iter().all(|s| says_something(s))
}

/// One worker's tallies per category and per kind.
#[derive(Default)]
struct Tallies {
    by_category: BTreeMap<String, Tally>,
    by_kind: BTreeMap<String, Tally>,
}

impl Tallies {
    fn into_profile(self, profile: &mut Profile) {
        profile.by_category = self.by_category.into_iter().map(|(c, t)| (c, t.figures())).collect();
        profile.by_kind = self.by_kind.into_iter().map(|(k, t)| (k, t.figures())).collect();
    }
}

/// The name the conductor's plans' figures go by, as a worker's go by the worker's.
pub const PLANS: &str = "the conductor's plans";

/// The kinds of item a suite has (`baton_eval`'s `Kind`), which a result's category is when the
/// item has no category of its own.
const KINDS: [&str; 4] = ["number", "choice", "code", "exact"];

/// Tallies of one worker on one category, before they become [`CategoryFigures`].
struct Tally {
    right: u32,
    n: u32,
    cost_usd: f64,
    cost_complete: bool,
    tokens: u64,
    latencies: Vec<u64>,
}

impl Default for Tally {
    fn default() -> Self {
        Tally { right: 0, n: 0, cost_usd: 0.0, cost_complete: true, tokens: 0, latencies: Vec::new() }
    }
}

/// One result's figures, as a tally adds them.
struct ResultFigures {
    correct: bool,
    cost_usd: f64,
    cost_complete: bool,
    tokens: u64,
    latency_ms: u64,
}

impl ResultFigures {
    fn of(r: &sqlx::sqlite::SqliteRow) -> Result<ResultFigures, StoreError> {
        Ok(ResultFigures {
            correct: r.try_get("correct")?,
            cost_usd: r.try_get("cost_usd")?,
            cost_complete: r.try_get("cost_complete")?,
            tokens: r.try_get::<i64, _>("input_tokens")?.max(0) as u64
                + r.try_get::<i64, _>("output_tokens")?.max(0) as u64,
            latency_ms: r.try_get::<i64, _>("latency_ms")?.max(0) as u64,
        })
    }

    fn add_to(&self, t: &mut Tally) {
        t.right += u32::from(self.correct);
        t.n += 1;
        t.cost_usd += self.cost_usd;
        t.cost_complete &= self.cost_complete;
        t.tokens += self.tokens;
        t.latencies.push(self.latency_ms);
    }
}

impl Tally {
    fn figures(mut self) -> CategoryFigures {
        self.latencies.sort_unstable();
        let n = u64::from(self.n.max(1));
        CategoryFigures {
            right: self.right,
            n: self.n,
            cost_per_item_usd: self.cost_usd / n as f64,
            cost_complete: self.cost_complete,
            latency_p50_ms: self.latencies.get(self.latencies.len() / 2).copied().unwrap_or(0),
            tokens_per_item: self.tokens / n,
        }
    }
}

impl Store {
    /// The profiles of `workers` (name, identity), from every learning run that measured a
    /// worker of the same identity; a worker measured only under another identity has a
    /// stale profile (with the figures of the newest such run, for showing), one never
    /// measured none.
    ///
    /// With `conductor` (its [identity](baton_engine::ConductorSpec::identity)), also the figures
    /// of its sampled plans, from the learning runs that sampled them with this conductor over
    /// the same workers as now (any other pool's plans could not use these workers).
    pub async fn learned(&self, workers: &[(String, String)], conductor: Option<&str>) -> Result<Learned, StoreError> {
        let mut tallies: Vec<Tallies> = workers.iter().map(|_| Tallies::default()).collect();
        // Per worker, the questions already counted: learning runs are read newest first, and
        // an item learned again counts once, as it went the last time.
        let mut counted: Vec<HashSet<String>> = vec![HashSet::new(); workers.len()];
        let mut learned_in: Vec<Vec<String>> = vec![Vec::new(); workers.len()];
        let mut stale: Vec<Option<(String, String, String)>> = vec![None; workers.len()];
        let mut questions: BTreeMap<String, String> = BTreeMap::new();
        let mut plans: BTreeMap<String, LearnedPlan> = BTreeMap::new();
        let mut planned = Tallies::default();
        let (mut planned_counted, mut planned_in) = (HashSet::new(), Vec::new());
        let now: HashSet<&str> = workers.iter().map(|(_, identity)| identity.as_str()).collect();
        // Per workflow (on this pool's workers): its tallies, the questions counted, its runs.
        let mut flows: BTreeMap<Workflow, (Tallies, HashSet<String>, Vec<String>)> = BTreeMap::new();
        for evaluation in self.evaluations().await? {
            let config = &evaluation.config;
            if config["learn"] != serde_json::json!(true) {
                continue;
            }
            let names: Vec<&str> =
                config["workers"].as_array().into_iter().flatten().filter_map(|v| v.as_str()).collect();
            let identities: Vec<&str> =
                config["identities"].as_array().into_iter().flatten().filter_map(|v| v.as_str()).collect();
            for (w, (name, identity)) in workers.iter().enumerate() {
                if let Some(j) = identities.iter().position(|i| i == identity) {
                    let Some(then) = names.get(j) else { continue };
                    let rows = self
                        .tally(
                            &evaluation.id,
                            &format!("single:{then}"),
                            &mut tallies[w],
                            &mut counted[w],
                            &mut questions,
                        )
                        .await?;
                    if rows > 0 {
                        learned_in[w].push(evaluation.id.clone());
                    }
                } else if let Some(j) = names.iter().position(|n| n == name)
                    && stale[w].is_none()
                {
                    let then = identities.get(j).map(|i| (*i).to_owned()).unwrap_or_default();
                    stale[w] = Some((evaluation.id.clone(), (*names.get(j).unwrap_or(&"")).to_owned(), then));
                }
            }
            let same_pool = identities.len() == workers.len() && identities.iter().all(|i| now.contains(i));
            if same_pool && conductor.is_some() && config["conductor"].as_str() == conductor {
                let (counted, questions) = (&mut planned_counted, &mut questions);
                if self.tally(&evaluation.id, "conductor", &mut planned, counted, questions).await? > 0 {
                    planned_in.push(evaluation.id.clone());
                }
            }
            // The run's worker numbers in this pool: the worker of the same identity, if any.
            let renumber: Vec<Option<usize>> =
                identities.iter().map(|i| workers.iter().position(|(_, now)| now == i)).collect();
            let searched: BTreeMap<String, Workflow> =
                serde_json::from_value(config["workflows"].clone()).unwrap_or_default();
            for (key, flow) in searched {
                let Some(here) = flow.renumbered(|w| renumber.get(w).copied().flatten()) else { continue };
                let (tallies, counted, runs) = flows.entry(here).or_default();
                if self.tally(&evaluation.id, &key, tallies, counted, &mut BTreeMap::new()).await? > 0 {
                    runs.push(evaluation.id.clone());
                }
            }
            for plan in self.right_plans(&evaluation.id, &renumber).await? {
                let cheaper = |kept: &LearnedPlan| (plan.cost_usd, plan.calls) < (kept.cost_usd, kept.calls);
                if plans.get(&plan.question).is_none_or(cheaper) {
                    plans.insert(plan.question.clone(), plan);
                }
            }
        }
        let marks = self.chat_marks().await?;
        let mut profiles = Vec::with_capacity(workers.len());
        for (w, (name, identity)) in workers.iter().enumerate() {
            let mut profile = Profile {
                worker: name.clone(),
                freshness: Freshness::None,
                identity: None,
                by_category: BTreeMap::new(),
                by_kind: BTreeMap::new(),
                learned_in: Vec::new(),
                marks: marks.get(identity).copied().unwrap_or_default(),
            };
            if !learned_in[w].is_empty() {
                profile.freshness = Freshness::Current;
                profile.identity = Some(identity.clone());
                std::mem::take(&mut tallies[w]).into_profile(&mut profile);
                profile.learned_in = learned_in[w].clone();
            } else if let Some((evaluation, then_name, then_identity)) = stale[w].take() {
                let mut old = Tallies::default();
                self.tally(
                    &evaluation,
                    &format!("single:{then_name}"),
                    &mut old,
                    &mut HashSet::new(),
                    &mut BTreeMap::new(),
                )
                .await?;
                profile.freshness = Freshness::Stale;
                profile.identity = Some(then_identity);
                old.into_profile(&mut profile);
                profile.learned_in = vec![evaluation];
            }
            profiles.push(profile);
        }
        let mut plans: Vec<LearnedPlan> = plans.into_values().collect();
        plans.sort_by(|a, b| a.cost_usd.total_cmp(&b.cost_usd).then(a.calls.cmp(&b.calls)));
        let mut variety = baton_engine::profile::PlanVariety::default();
        for run in &planned_in {
            let (samples, distinct) = self.plan_variety(run).await?;
            variety.samples += samples;
            variety.distinct += distinct;
        }
        let plan_variety = (variety.samples > 0).then_some(variety);
        let planned = (!planned_in.is_empty()).then(|| {
            let mut profile = Profile {
                worker: PLANS.to_owned(),
                freshness: Freshness::Current,
                identity: conductor.map(str::to_owned),
                by_category: BTreeMap::new(),
                by_kind: BTreeMap::new(),
                learned_in: planned_in,
                marks: ChatMarks::default(),
            };
            planned.into_profile(&mut profile);
            profile
        });
        let names: Vec<String> = workers.iter().map(|(name, _)| name.clone()).collect();
        let workflows = flows
            .into_iter()
            .filter(|(_, (_, _, runs))| !runs.is_empty())
            .map(|(flow, (tallies, _, runs))| {
                let mut profile = Profile {
                    worker: flow.key(&names),
                    freshness: Freshness::Current,
                    identity: None,
                    by_category: BTreeMap::new(),
                    by_kind: BTreeMap::new(),
                    learned_in: runs,
                    marks: ChatMarks::default(),
                };
                tallies.into_profile(&mut profile);
                (flow, profile)
            })
            .collect();
        let questions = questions.into_iter().collect();
        Ok(Learned { profiles, planned, questions, plans, workflows, plan_variety })
    }

    /// The plans of learning run `evaluation`'s conductor samples and searched workflows whose
    /// answers were right: one round, usable as written (no fallback), every step on a worker
    /// that `renumber` (the run's worker number → this pool's) still has.
    async fn right_plans(&self, evaluation: &str, renumber: &[Option<usize>]) -> Result<Vec<LearnedPlan>, StoreError> {
        if renumber.iter().all(Option::is_none) {
            return Ok(Vec::new());
        }
        let rows = sqlx::query(
            "SELECT r.question, e.category, e.cost_usd, e.calls, p.plan
             FROM eval_results e JOIN runs r ON r.uid = e.run_uid JOIN plans p ON p.run_id = r.id AND p.round = 0
             WHERE e.evaluation_id = ?1 AND e.correct = 1
               AND ((e.strategy = 'conductor' AND e.plan_valid = 1) OR e.strategy LIKE 'chain:%' OR e.strategy LIKE 'fan-out:%')
               AND NOT EXISTS (SELECT 1 FROM plans q WHERE q.run_id = r.id AND q.round > 0)",
        )
        .bind(evaluation)
        .fetch_all(&self.pool)
        .await?;
        let mut plans = Vec::new();
        for r in &rows {
            // Kept as `Plan::to_json` wrote it.
            let Ok(mut plan) = serde_json::from_str::<baton_plan::Plan>(&r.try_get::<String, _>("plan")?) else {
                continue;
            };
            let on_this_pool = plan.steps.iter_mut().all(|step| {
                let now = renumber.get(step.model_id).copied().flatten();
                step.model_id = now.unwrap_or(usize::MAX);
                now.is_some()
            });
            let subtasks: Vec<&str> = plan.steps.iter().map(|s| s.subtask.as_str()).collect();
            if on_this_pool && instructive(&subtasks) {
                plans.push(LearnedPlan {
                    question: r.try_get("question")?,
                    category: r.try_get("category")?,
                    plan,
                    cost_usd: r.try_get("cost_usd")?,
                    calls: r.try_get::<i64, _>("calls")?.max(0) as u64,
                });
            }
        }
        Ok(plans)
    }

    /// Of learning run `evaluation`'s conductor samples, how many there were and how many were
    /// distinct plans for their item (by the plan as it ran, `plans.plan`): samples that are
    /// one plan teach nothing a single one would not.
    pub async fn plan_variety(&self, evaluation: &str) -> Result<(u32, u32), StoreError> {
        let row = sqlx::query(
            "SELECT COUNT(*) AS samples, COUNT(DISTINCT e.item_id || char(0) || p.plan) AS distinct_plans
             FROM eval_results e JOIN runs r ON r.uid = e.run_uid JOIN plans p ON p.run_id = r.id AND p.round = 0
             WHERE e.evaluation_id = ?1 AND e.strategy = 'conductor'",
        )
        .bind(evaluation)
        .fetch_one(&self.pool)
        .await?;
        let count =
            |c: &str| -> Result<u32, StoreError> { Ok(row.try_get::<i64, _>(c)?.clamp(0, i64::from(u32::MAX)) as u32) };
        Ok((count("samples")?, count("distinct_plans")?))
    }

    /// The user's marks in compare in chat, by the identity of the worker that answered alone.
    /// Comparisons kept before identities were (schema 11) have none, and count for no one.
    async fn chat_marks(&self) -> Result<BTreeMap<String, ChatMarks>, StoreError> {
        let rows = sqlx::query(
            "SELECT worker_identity, preferred, COUNT(*) AS n FROM comparisons
             WHERE worker_identity IS NOT NULL AND preferred IS NOT NULL
             GROUP BY worker_identity, preferred",
        )
        .fetch_all(&self.pool)
        .await?;
        let mut marks: BTreeMap<String, ChatMarks> = BTreeMap::new();
        for r in &rows {
            let m = marks.entry(r.try_get("worker_identity")?).or_default();
            let n = r.try_get::<i64, _>("n")?.clamp(0, i64::from(u32::MAX)) as u32;
            match r.try_get::<&str, _>("preferred")? {
                "single" => m.better += n,
                "tie" => m.tie += n,
                _ => m.worse += n,
            }
        }
        Ok(marks)
    }

    /// The items the pool's current profiles were learned from: an evaluation leaves these out,
    /// so that it never scores what the pool was taught with. An error when the history cannot
    /// be read: an empty answer would let an evaluation score what was taught.
    pub async fn learned_items(&self, workers: &[(String, String)]) -> Result<LearnedItems, StoreError> {
        let learned = self.learned(workers, None).await?;
        let runs: BTreeSet<&str> = learned.profiles.iter().flat_map(|p| &p.learned_in).map(String::as_str).collect();
        let suites: BTreeMap<String, String> =
            self.evaluations().await?.into_iter().map(|e| (e.id, e.suite_sha256)).collect();
        let mut items = BTreeSet::new();
        for run in runs {
            let Some(suite) = suites.get(run) else { continue };
            let ids: Vec<String> =
                sqlx::query_scalar("SELECT DISTINCT item_id FROM eval_results WHERE evaluation_id = ?1")
                    .bind(run)
                    .fetch_all(&self.pool)
                    .await?;
            items.extend(ids.into_iter().map(|id| (suite.clone(), id)));
        }
        Ok(LearnedItems { items, questions: learned.questions.into_iter().map(|(q, _)| q).collect() })
    }

    /// Adds the results of worker `name` alone in learning run `evaluation` to `tallies` (by
    /// category, and by kind where the result says its item's kind: results kept before kinds
    /// were (schema 12) only when their category is a kind), but
    /// for questions in `counted` (which it extends), and its questions (with their categories)
    /// to `questions`. Returns how many results it added.
    async fn tally(
        &self,
        evaluation: &str,
        strategy: &str,
        tallies: &mut Tallies,
        counted: &mut HashSet<String>,
        questions: &mut BTreeMap<String, String>,
    ) -> Result<usize, StoreError> {
        let rows = sqlx::query(
            "SELECT e.item_id, e.category, e.kind, e.correct, e.cost_usd, e.cost_complete, e.input_tokens, e.output_tokens,
                    e.latency_ms, r.question
             FROM eval_results e LEFT JOIN runs r ON r.uid = e.run_uid
             WHERE e.evaluation_id = ?1 AND e.strategy = ?2
             ORDER BY e.item_id, e.repeat",
        )
        .bind(evaluation)
        .bind(strategy)
        .fetch_all(&self.pool)
        .await?;
        let before = counted.clone();
        let mut added = 0;
        for r in &rows {
            let question: Option<String> = r.try_get("question")?;
            let item: String = r.try_get("item_id")?;
            // A run deleted from the history leaves its result without a question: the item's id
            // in this learning run stands in for it.
            let key = question.clone().unwrap_or_else(|| format!("{evaluation}/{item}"));
            if before.contains(&key) {
                continue;
            }
            counted.insert(key);
            added += 1;
            let category: String = r.try_get("category")?;
            let kind = r.try_get::<Option<String>, _>("kind")?.or_else(|| {
                let known = KINDS.contains(&category.as_str());
                known.then(|| category.clone())
            });
            let figures = ResultFigures::of(r)?;
            figures.add_to(tallies.by_category.entry(category.clone()).or_default());
            if let Some(kind) = kind {
                figures.add_to(tallies.by_kind.entry(kind).or_default());
            }
            if let Some(question) = question {
                questions.entry(question).or_insert(category);
            }
        }
        Ok(added)
    }
}

#[cfg(test)]
mod tests {
    use super::instructive;

    #[test]
    fn only_plans_whose_steps_say_what_they_are_for_become_examples() {
        assert!(instructive(&["Answer the question."]));
        assert!(instructive(&["List the facts it needs.", "Answer it from them."]));
        // Seen in a real learning run: right, because every worker was given the question.
        assert!(!instructive(&[".1", ".2", ".3", ".4", ".5"]));
        assert!(!instructive(&["2017-01-01"]));
        assert!(!instructive(&["The balance of power", "The balance of power"]));
        assert!(!instructive(&["Solve"]));
    }
}
