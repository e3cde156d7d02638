//! What a pool learned of its workers (`baton pool learn`), and the choices drawn from it: which
//! worker is the cheapest that is as good on a kind of question, and whether the measurements
//! name it by a margin clear enough to answer without asking the conductor for a plan.
//!
//! A [`Profile`] belongs to a worker as its [`identity`](crate::WorkerSpec::identity) defines it
//! (provider, model, endpoint and the settings that shape its answers). A worker whose identity
//! changed since it was measured has a stale profile: shown, never used.
//!
//! What the profiles choose is a [`Measured`] ([`measure`]): a pool holds it, filled from the
//! history, as [`crate::Pool::learned`].

use std::collections::BTreeMap;

use serde::Serialize;

use crate::learned::{Choices, MIN_CATEGORY_ITEMS, Measured};
use crate::workflow::Workflow;

/// What a worker did alone on one category's items while the pool learned.
#[derive(Debug, Clone, Default, PartialEq, Serialize, ts_rs::TS)]
pub struct CategoryFigures {
    pub right: u32,
    /// Runs scored (items × repeats).
    pub n: u32,
    /// Dollars per run; 0 for local models and unpriced calls (see `cost_complete`).
    pub cost_per_item_usd: f64,
    pub cost_complete: bool,
    pub latency_p50_ms: u64,
    /// Input and output tokens per run.
    pub tokens_per_item: u64,
}

impl CategoryFigures {
    pub fn accuracy(&self) -> f64 {
        if self.n == 0 { 0.0 } else { f64::from(self.right) / f64::from(self.n) }
    }

    /// The 95% Wilson interval of the accuracy: honest at small n, where 2 of 3 is not 67%.
    pub fn interval(&self) -> (f64, f64) {
        wilson(self.right, self.n)
    }
}

/// Whether a worker's profile can be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ts_rs::TS)]
#[serde(rename_all = "snake_case")]
pub enum Freshness {
    /// Learned with the worker as it is now.
    Current,
    /// Learned when the worker was defined otherwise (another model, endpoint or setting).
    Stale,
    /// Never learned.
    None,
}

/// One worker's profile, per category and per kind.
#[derive(Debug, Clone, PartialEq, Serialize, ts_rs::TS)]
pub struct Profile {
    pub worker: String,
    pub freshness: Freshness,
    /// The identity the figures were learned with (for a stale profile, not the worker's now).
    pub identity: Option<String>,
    /// Per category: the item's own, else its kind (the suite's `category`, else `kind`).
    pub by_category: BTreeMap<String, CategoryFigures>,
    /// Per kind (the form of the answer: `number`, `choice`, `code` or `exact`), over every
    /// category. A suite whose categories are many and thin (MMLU's 57 subjects) still tells
    /// which worker is good at its kind of question.
    pub by_kind: BTreeMap<String, CategoryFigures>,
    /// The learning runs these figures come from.
    pub learned_in: Vec<String>,
    /// The user's marks in compare in chat, for the worker as it is now (whatever
    /// [`Self::freshness`] says of the learned figures).
    pub marks: ChatMarks,
}

impl Profile {
    /// Whether `kind`'s figures are a category's over again: where one category holds every
    /// item of the kind (the suite's items of that kind have one category, or none, so go by
    /// the kind's name), the two are the same runs with the same figures. Shown or told twice,
    /// it says nothing new; the kind still places questions no category does.
    pub fn repeats_a_category(&self, kind: &str) -> bool {
        self.by_kind.get(kind).is_some_and(|k| self.by_category.values().any(|c| c == k))
    }
}

/// How the user marked this worker's answer alone against the conductor's answer to the same
/// question (compare in chat). A mark weighs the worker against the pool, not against the other
/// workers, and a chat question has no category: so marks are told to the conductor and shown,
/// but choose no worker by themselves.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, ts_rs::TS)]
pub struct ChatMarks {
    /// Marked better than the conductor's answer.
    pub better: u32,
    /// Marked as good.
    pub tie: u32,
    /// The conductor's answer marked better.
    pub worse: u32,
}

impl ChatMarks {
    pub fn total(&self) -> u32 {
        self.better + self.tie + self.worse
    }

    /// In words the conductor reads: "In chat, the user marked its answer alone better than the
    /// pool's 2 times, as good 1 time and worse 3 times." `None` with no marks.
    fn sentence(&self) -> Option<String> {
        let times = |n: u32| if n == 1 { "1 time".to_owned() } else { format!("{n} times") };
        (self.total() > 0).then(|| {
            format!(
                "In chat, the user marked its answer alone better than the pool's {}, as good {} and worse {}.",
                times(self.better),
                times(self.tie),
                times(self.worse)
            )
        })
    }
}

/// How close to the best a worker's accuracy must be to count as "as good": within this share.
pub const AS_GOOD_WITHIN: f64 = 0.05;

/// Where every worker is as good, the lower end of the choice's interval must reach this for the
/// question to go to it alone.
pub const ALONE_AT_LEAST: f64 = 0.5;

/// The choices the profiles support, for the executor (see [`Measured`]). `questions` are the
/// learned items with their categories: a new question is placed by the nearest of them, and
/// where none is near (or its category was too thin to choose by), by its kind.
/// Only current profiles count, and only categories (and kinds) where every current worker has
/// at least [`MIN_CATEGORY_ITEMS`] runs. A worker with no current profile (never learned, or
/// changed since) is in no choice; while one is, no choice is clear: it might be the better one.
pub fn measure(profiles: &[Profile], questions: Vec<(String, String)>) -> Measured {
    // Marks are the worker's as it is now, so a stale or unlearned profile's count too.
    let strengths: BTreeMap<usize, String> = profiles
        .iter()
        .enumerate()
        .filter_map(|(w, p)| {
            let learned = if p.freshness == Freshness::Current { learned_line(p) } else { None };
            let said: Vec<String> = learned.into_iter().chain(p.marks.sentence()).collect();
            (!said.is_empty()).then(|| (w, said.join(" ")))
        })
        .collect();
    let current: Vec<(usize, &Profile)> =
        profiles.iter().enumerate().filter(|(_, p)| p.freshness == Freshness::Current).collect();
    if current.is_empty() {
        return Measured { strengths, ..Measured::default() };
    }
    let everyone = current.len() == profiles.len();
    let names = profiles_names(profiles);
    let overall: Vec<(usize, CategoryFigures)> = current.iter().map(|(w, p)| (*w, total(p))).collect();
    let overall: Vec<(usize, &CategoryFigures)> = overall.iter().map(|(w, f)| (*w, f)).collect();
    let best = choose(&overall, &names).map(|(w, _)| w);
    Measured {
        best,
        by_category: choices(&current, |p| &p.by_category, everyone, best, &names),
        by_kind: choices(&current, |p| &p.by_kind, everyone, best, &names),
        questions,
        strengths,
        plans: Vec::new(),
    }
}

/// Per key of `figures_of` (categories or kinds): the cheapest worker as good as the best, and
/// where that choice is clear, why. Only keys where every current worker has at least
/// [`MIN_CATEGORY_ITEMS`] runs; a choice is clear only when `everyone` has a current profile.
/// Whether plans help is weighed later ([`weigh_plans`]).
///
/// A key's few items are a noisy guide, the whole suite a better one: where the worker best
/// over everything learned (`overall`) is not as good on a key, the key's own best takes its
/// place only if the margin between the two is clear (their intervals apart). One item more of
/// ten is noise, not a reason to send a kind of question to a worker that is weaker overall. A
/// cheaper worker as good on the key still takes it: that choice rests on cost, not on the
/// margin.
fn choices<'p>(
    current: &[(usize, &'p Profile)],
    figures_of: impl Fn(&'p Profile) -> &'p BTreeMap<String, CategoryFigures>,
    everyone: bool,
    overall: Option<usize>,
    names: &[&str],
) -> Choices {
    let mut keys: Vec<&String> = current.iter().flat_map(|(_, p)| figures_of(p).keys()).collect();
    keys.sort();
    keys.dedup();
    let mut chosen = Choices::default();
    for key in keys {
        let figures: Vec<(usize, &CategoryFigures)> =
            current.iter().filter_map(|(w, p)| figures_of(p).get(key).map(|f| (*w, f))).collect();
        if figures.len() < current.len() || figures.iter().any(|(_, f)| (f.n as usize) < MIN_CATEGORY_ITEMS) {
            continue;
        }
        if let Some((mut worker, mut why)) = choose(&figures, names) {
            let of = |w: usize| figures.iter().find(|(x, _)| *x == w).map(|(_, f)| *f);
            let top = figures.iter().map(|(_, f)| f.accuracy()).fold(0.0, f64::max);
            if let (Some(b), Some(mine)) = (overall.filter(|b| *b != worker), of(worker))
                && let Some(theirs) = of(b)
                && theirs.accuracy() < top - AS_GOOD_WITHIN - 1e-9
                && mine.interval().0 <= theirs.interval().1
            {
                (worker, why) = (b, None);
            }
            chosen.best.insert(key.clone(), worker);
            if let Some(why) = why.filter(|_| everyone) {
                chosen.clear.insert(key.clone(), why);
            }
        }
    }
    chosen
}

/// Where a plan is not known to help: for each category and kind whose choice (see [`measure`])
/// is not clear already, the conductor's sampled plans (`planned`, scored while the pool
/// learned) were not shown to be right more often than that worker alone: the lower end of
/// their 95% interval is not above the worker's accuracy. Such a question goes to the worker
/// alone, as a clear choice does. A step is added only where the measurements say it helps: a
/// plan costs the conductor's time and the steps' calls, so one item more of ten is not enough.
/// Only where the plans have at least [`MIN_CATEGORY_ITEMS`] runs, and every worker a current
/// profile (a worker not measured might be what a plan needs).
pub fn weigh_plans(measured: &mut Measured, profiles: &[Profile], planned: &Profile) {
    if profiles.iter().any(|p| p.freshness != Freshness::Current) {
        return;
    }
    let name = |w: usize| profiles.get(w).map_or("?", |p| p.worker.as_str());
    let weigh = |choices: &mut Choices, figures_of: &dyn Fn(&Profile) -> &BTreeMap<String, CategoryFigures>| {
        let Choices { best, clear, no_gain, .. } = choices;
        no_gain.clear();
        for (key, &w) in best.iter().filter(|(key, _)| !clear.contains_key(*key)) {
            let (Some(alone), Some(plans)) =
                (profiles.get(w).and_then(|p| figures_of(p).get(key)), figures_of(planned).get(key))
            else {
                continue;
            };
            if (plans.n as usize) < MIN_CATEGORY_ITEMS || plans.interval().0 > alone.accuracy() {
                continue;
            }
            let why = format!(
                "the conductor's plans were right on {} of {} when the pool learned, {} alone on {} of {}: a plan is not known to help",
                plans.right,
                plans.n,
                name(w),
                alone.right,
                alone.n
            );
            no_gain.insert(key.clone(), why);
        }
    };
    weigh(&mut measured.by_category, &|p| &p.by_category);
    weigh(&mut measured.by_kind, &|p| &p.by_kind);
}

/// Where a learned workflow beats every worker alone: for each category and kind, the
/// cheapest of the `flows` (each with its figures, as a worker's profile holds them) that were
/// right by a clear margin over every worker alone (the lower end of the workflow's 95%
/// interval above the upper end of each worker's) becomes the key's choice in
/// [`Choices::flows`], and runs of that kind execute it. A worker as good as the workflow is
/// never beaten by a clear margin, so a single worker still wins wherever it is as good (and
/// one call is cheaper than two). Only where the workflow and every worker have at least
/// [`MIN_CATEGORY_ITEMS`] runs on the key, and every worker a current profile (a worker not
/// measured might do as well alone).
pub fn weigh_workflows(measured: &mut Measured, profiles: &[Profile], flows: &[(Workflow, Profile)]) {
    if profiles.is_empty() || profiles.iter().any(|p| p.freshness != Freshness::Current) {
        return;
    }
    let names: Vec<String> = profiles.iter().map(|p| p.worker.clone()).collect();
    let weigh = |choices: &mut Choices, figures_of: &dyn Fn(&Profile) -> &BTreeMap<String, CategoryFigures>| {
        choices.flows.clear();
        let mut keys: Vec<&String> = flows.iter().flat_map(|(_, p)| figures_of(p).keys()).collect();
        keys.sort();
        keys.dedup();
        for key in keys {
            let alone: Option<Vec<&CategoryFigures>> = profiles.iter().map(|p| figures_of(p).get(key)).collect();
            let Some(alone) = alone.filter(|a| a.iter().all(|f| f.n as usize >= MIN_CATEGORY_ITEMS)) else {
                continue;
            };
            let highest = alone.iter().map(|f| f.interval().1).fold(0.0, f64::max);
            let clear: Vec<(&Workflow, &CategoryFigures)> = flows
                .iter()
                .filter_map(|(w, p)| figures_of(p).get(key).map(|f| (w, f)))
                .filter(|(_, f)| f.n as usize >= MIN_CATEGORY_ITEMS && f.interval().0 > highest)
                .collect();
            let top = clear.iter().map(|(_, f)| f.accuracy()).fold(0.0, f64::max);
            let cheapest = clear.iter().filter(|(_, f)| f.accuracy() >= top - AS_GOOD_WITHIN - 1e-9).min_by(|a, b| {
                let cost = |f: &CategoryFigures| if f.cost_complete { f.cost_per_item_usd } else { f64::INFINITY };
                cost(a.1)
                    .total_cmp(&cost(b.1))
                    .then(a.0.calls().cmp(&b.0.calls()))
                    .then(a.1.latency_p50_ms.cmp(&b.1.latency_p50_ms))
                    .then(a.0.cmp(b.0))
            });
            let Some((workflow, f)) = cheapest else { continue };
            let best_alone = alone.iter().map(|f| f.right).max().unwrap_or(0);
            let why = format!(
                "{} was right on {} of {} when the pool learned, no worker alone on more than {} of {}",
                workflow.describe(&names),
                f.right,
                f.n,
                best_alone,
                alone.first().map_or(0, |f| f.n)
            );
            choices.flows.insert(key.clone(), crate::learned::FlowChoice { workflow: (*workflow).clone(), why });
        }
    };
    weigh(&mut measured.by_category, &|p| &p.by_category);
    weigh(&mut measured.by_kind, &|p| &p.by_kind);
}

/// A kind of question in words: "multiple-choice" for `choice`. Any other text is its own.
pub fn kind_words(kind: &str) -> &str {
    match kind {
        "number" => "numeric",
        "choice" => "multiple-choice",
        "code" => "coding",
        "exact" => "exact-answer",
        other => other,
    }
}

fn profiles_names(profiles: &[Profile]) -> Vec<&str> {
    profiles.iter().map(|p| p.worker.as_str()).collect()
}

/// What a worker did alone, in words the conductor reads: "When this pool learned, it was
/// right on 8 of 8 arithmetic questions and 0 of 8 trivia questions." Categories with fewer than
/// [`MIN_CATEGORY_ITEMS`] runs are left out (1 of 1 says nothing); where some were, the kinds
/// their runs add up to are said instead ("10 of 20 multiple-choice questions"), unless a kind
/// is itself a category already said. `None` for a profile with nothing worth saying.
fn learned_line(profile: &Profile) -> Option<String> {
    let enough = |f: &&CategoryFigures| f.n as usize >= MIN_CATEGORY_ITEMS;
    let said: Vec<(&String, &CategoryFigures)> = profile.by_category.iter().filter(|(_, f)| enough(f)).collect();
    let thin = profile.by_category.values().any(|f| f.n > 0 && !enough(&f));
    let kinds: Vec<(&String, &CategoryFigures)> = if thin {
        profile.by_kind.iter().filter(|(k, f)| enough(f) && !profile.repeats_a_category(k)).collect()
    } else {
        Vec::new()
    };
    let parts: Vec<String> = said
        .into_iter()
        .chain(kinds)
        .map(|(key, f)| format!("{} of {} {} questions", f.right, f.n, kind_words(key)))
        .collect();
    let listed = match parts.as_slice() {
        [] => return None,
        [one] => one.clone(),
        [rest @ .., last] => format!("{} and {last}", rest.join(", ")),
    };
    Some(format!("When this pool learned, it was right on {listed}."))
}

/// A profile's figures over all its categories.
pub fn total(profile: &Profile) -> CategoryFigures {
    let mut all = CategoryFigures { cost_complete: true, ..CategoryFigures::default() };
    let (mut cost, mut tokens, mut latencies) = (0.0, 0u64, Vec::new());
    for f in profile.by_category.values() {
        all.right += f.right;
        all.n += f.n;
        all.cost_complete &= f.cost_complete;
        cost += f.cost_per_item_usd * f64::from(f.n);
        tokens += f.tokens_per_item * u64::from(f.n);
        latencies.push(f.latency_p50_ms);
    }
    if all.n > 0 {
        all.cost_per_item_usd = cost / f64::from(all.n);
        all.tokens_per_item = tokens / u64::from(all.n);
    }
    latencies.sort_unstable();
    all.latency_p50_ms = latencies.get(latencies.len() / 2).copied().unwrap_or(0);
    all
}

/// The cheapest worker as good as the best (within [`AS_GOOD_WITHIN`]), by cost per item (a
/// worker whose price is unknown counts as dearest: its cost is a lower bound), then time, then
/// tokens; and, when the measurements leave no doubt, why it may answer without a plan. `None`
/// when no worker got anything right.
///
/// No doubt means: at least two workers were measured, and the choice's 95% interval lies wholly
/// above the interval of every worker that is not as good; where every worker is as good, the
/// choice is right more often than not (the lower end of its interval at least
/// [`ALONE_AT_LEAST`]), since then no worker is known to do better and a plan is not known to
/// help.
fn choose(figures: &[(usize, &CategoryFigures)], names: &[&str]) -> Option<(usize, Option<String>)> {
    let best = figures.iter().map(|(_, f)| f.accuracy()).fold(0.0, f64::max);
    if best == 0.0 {
        return None;
    }
    let as_good = |f: &CategoryFigures| f.accuracy() >= best - AS_GOOD_WITHIN - 1e-9;
    let (worker, chosen) = figures.iter().filter(|(_, f)| as_good(f)).min_by(|a, b| {
        let key = |f: &CategoryFigures| {
            let cost = if f.cost_complete { f.cost_per_item_usd } else { f64::INFINITY };
            (cost, f.latency_p50_ms, f.tokens_per_item)
        };
        let (ka, kb) = (key(a.1), key(b.1));
        ka.0.total_cmp(&kb.0).then(ka.1.cmp(&kb.1)).then(ka.2.cmp(&kb.2)).then(a.0.cmp(&b.0))
    })?;
    let low = chosen.interval().0;
    let others: Vec<&CategoryFigures> = figures.iter().filter(|(_, f)| !as_good(f)).map(|(_, f)| *f).collect();
    let clear = figures.len() >= 2
        && if others.is_empty() { low >= ALONE_AT_LEAST } else { others.iter().all(|f| f.interval().1 < low) };
    let name = names.get(*worker).copied().unwrap_or("?");
    let why = clear.then(|| {
        format!(
            "{name} was right on {} of {} when the pool learned it, the cheapest as good as the best",
            chosen.right, chosen.n
        )
    });
    Some((*worker, why))
}

/// What the pool learned, as `baton pool show` and the Workers screen show it: each worker's
/// profile beside its identity now, and where each kind of question goes because of it.
#[derive(Debug, Clone, PartialEq, Serialize, ts_rs::TS)]
pub struct PoolLearning {
    /// In the pool's order.
    pub workers: Vec<WorkerLearning>,
    /// The conductor's sampled plans, scored as a worker's answers are, where they were
    /// measured with this conductor over these workers.
    pub plans: Option<WorkerLearning>,
    /// The workflows search found while the pool learned, each with its figures (`worker` is
    /// the workflow in words), on this pool's workers.
    pub workflows: Vec<WorkerLearning>,
    /// Each learned kind of question and the worker (or workflow) it goes to.
    pub routes: Vec<KindRoute>,
    /// The worker the pool names as its fallback (`fallback_worker`): then what was learned
    /// routes nothing (and with `route = "always"` every question goes to it).
    pub named_fallback: Option<String>,
    /// `[conductor] route`.
    pub route: crate::Route,
    /// How varied the conductor's sampled plans were, where they were measured.
    pub plan_variety: Option<PlanVariety>,
}

/// The conductor's samples while the pool learned: how many, and how many were distinct plans
/// for their item. A share near 0 says the samples were one plan over again (a greedy
/// conductor), and learning could keep only what that one plan did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, ts_rs::TS)]
pub struct PlanVariety {
    pub samples: u32,
    pub distinct: u32,
}

/// One worker's profile, for showing.
#[derive(Debug, Clone, PartialEq, Serialize, ts_rs::TS)]
pub struct WorkerLearning {
    pub worker: String,
    pub freshness: Freshness,
    /// The identity it was learned as (for a stale profile, not [`Self::identity_now`]).
    pub identity_learned: Option<String>,
    pub identity_now: String,
    /// Whether its calls have a price (else its cost shows as unknown, not as $0).
    pub priced: bool,
    pub learned_in: Vec<String>,
    pub categories: Vec<CategoryRow>,
    /// Per kind, over every category; only kinds that are not a category of their own (those
    /// are in [`Self::categories`] already).
    pub kinds: Vec<CategoryRow>,
    pub marks: ChatMarks,
}

/// A worker's figures on one kind of question, with the 95% interval of its accuracy.
#[derive(Debug, Clone, PartialEq, Serialize, ts_rs::TS)]
pub struct CategoryRow {
    pub category: String,
    /// How it is shown: the category, or for a kind over categories "any multiple-choice".
    pub label: String,
    pub figures: CategoryFigures,
    pub low: f64,
    pub high: f64,
}

/// Where questions of one kind go.
#[derive(Debug, Clone, PartialEq, Serialize, ts_rs::TS)]
pub struct KindRoute {
    /// The category, or with [`Self::by_kind`] the kind.
    pub category: String,
    /// A route by the question's kind, for a question not placed in a category of its own.
    pub by_kind: bool,
    /// How it is shown: the category, or for a kind "other multiple-choice".
    pub label: String,
    /// The worker alone, or with [`RouteHow::Workflow`] the workflow's first worker.
    pub worker: String,
    /// With [`RouteHow::Workflow`], the workflow in words: "a, then b seeing a's answer".
    pub workflow: Option<String>,
    pub how: RouteHow,
}

/// How a kind of question reaches its worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ts_rs::TS)]
#[serde(rename_all = "snake_case")]
pub enum RouteHow {
    /// Alone, without a plan, because the pool says `route = "always"`.
    Always,
    /// Alone, without a plan, because the measurements name it by a clear margin.
    Clear,
    /// Alone, without a plan, because the conductor's plans were not shown to do better than it alone.
    NoGain,
    /// The conductor plans, with this worker as the plan's lead and the fallback.
    Lead,
    /// A learned workflow, without a plan, because it beat every worker alone by a clear margin.
    Workflow,
}

/// `profiles` (in `pool`'s order, as [`measure`] takes them), the conductor's `planned`
/// figures and the learned workflows' (`flows`) made ready to show.
pub fn learning(
    pool: &crate::Pool,
    profiles: &[Profile],
    planned: Option<&Profile>,
    flows: &[(Workflow, Profile)],
) -> PoolLearning {
    let shown = |p: &Profile, identity_now: String, priced: bool| WorkerLearning {
        worker: p.worker.clone(),
        freshness: p.freshness,
        identity_learned: p.identity.clone(),
        identity_now,
        priced,
        learned_in: p.learned_in.clone(),
        categories: rows(p.by_category.iter(), |category| category.to_owned()),
        kinds: rows(p.by_kind.iter().filter(|(k, _)| !p.repeats_a_category(k)), |kind| {
            format!("any {}", kind_words(kind))
        }),
        marks: p.marks,
    };
    let workers = pool
        .workers
        .iter()
        .zip(profiles)
        .map(|(w, p)| shown(p, w.identity(), !matches!(w.pricing(), crate::prices::Pricing::Unknown)))
        .collect();
    // The plans' cost is the workers' calls with the conductor's: priced where every worker is.
    let priced = pool.workers.iter().all(|w| !matches!(w.pricing(), crate::prices::Pricing::Unknown));
    let plans = planned.map(|p| shown(p, pool.options.conductor.identity(), priced));
    let names: Vec<String> = pool.workers.iter().map(|w| w.name.clone()).collect();
    let workflows = flows
        .iter()
        .map(|(flow, p)| {
            let on = flow.workers();
            let priced = on
                .iter()
                .all(|w| pool.workers.get(*w).is_some_and(|w| !matches!(w.pricing(), crate::prices::Pricing::Unknown)));
            WorkerLearning { worker: flow.describe(&names), ..shown(p, flow.key(&names), priced) }
        })
        .collect();
    let fallback = &pool.options.fallback;
    let name = |w: usize| names.get(w).cloned().unwrap_or_else(|| "?".to_owned());
    if fallback.worker.is_some() {
        let named = fallback.worker.map(name);
        let route = fallback.route;
        return PoolLearning {
            workers,
            plans,
            workflows,
            routes: Vec::new(),
            named_fallback: named,
            route,
            plan_variety: None,
        };
    }
    let mut measured = measure(profiles, Vec::new());
    if let Some(planned) = planned {
        weigh_plans(&mut measured, profiles, planned);
    }
    weigh_workflows(&mut measured, profiles, flows);
    let route_of = |choices: &Choices, key: &str, by_kind: bool, label: String| {
        let flow = choices.flows.get(key).filter(|_| fallback.route != crate::Route::Never);
        let worker = choices.best.get(key).copied();
        let how = match fallback.route {
            _ if flow.is_some() => RouteHow::Workflow,
            crate::Route::Always => RouteHow::Always,
            crate::Route::Auto if choices.clear.contains_key(key) => RouteHow::Clear,
            crate::Route::Auto if choices.no_gain.contains_key(key) => RouteHow::NoGain,
            _ => RouteHow::Lead,
        };
        let lead = flow.and_then(|f| f.workflow.workers().first().copied()).or(worker)?;
        Some(KindRoute {
            category: key.to_owned(),
            by_kind,
            label,
            worker: name(lead),
            workflow: flow.map(|f| f.workflow.describe(&names)),
            how,
        })
    };
    let keys = |c: &Choices| -> Vec<String> {
        let mut keys: Vec<String> = c.best.keys().chain(c.flows.keys()).cloned().collect();
        keys.sort();
        keys.dedup();
        keys
    };
    let (categories, kinds) = (&measured.by_category, &measured.by_kind);
    let category_keys = keys(categories);
    let by_category = category_keys.iter().filter_map(|c| route_of(categories, c, false, c.clone()));
    let by_kind = keys(kinds)
        .into_iter()
        .filter(|kind| !category_keys.contains(kind))
        .filter_map(|kind| route_of(kinds, &kind, true, format!("other {}", kind_words(&kind))));
    let routes = by_category.chain(by_kind).collect();
    PoolLearning { workers, plans, workflows, routes, named_fallback: None, route: fallback.route, plan_variety: None }
}

/// Figures made ready to show, with their intervals.
fn rows<'a>(
    figures: impl Iterator<Item = (&'a String, &'a CategoryFigures)>,
    label: impl Fn(&str) -> String,
) -> Vec<CategoryRow> {
    figures
        .map(|(category, f)| {
            let (low, high) = f.interval();
            CategoryRow { category: category.clone(), label: label(category), figures: f.clone(), low, high }
        })
        .collect()
}

/// The 95% Wilson score interval for `right` of `n`.
pub fn wilson(right: u32, n: u32) -> (f64, f64) {
    if n == 0 {
        return (0.0, 1.0);
    }
    let (n, p, z) = (f64::from(n), f64::from(right) / f64::from(n), 1.96_f64);
    let centre = (p + z * z / (2.0 * n)) / (1.0 + z * z / n);
    let half = z * (p * (1.0 - p) / n + z * z / (4.0 * n * n)).sqrt() / (1.0 + z * z / n);
    ((centre - half).max(0.0), (centre + half).min(1.0))
}

#[cfg(test)]
mod tests;
