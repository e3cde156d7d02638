//! The day's spending cap (`daily_max_cost_usd`): one ledger for the server, of what was spent
//! today (UTC; across restarts through the history) and what the runs in flight hold.
//!
//! A run is admitted only with a hold on the day: its worst case, reserved against what is left
//! once the spending and the other runs' holds are counted, and given to the run as its cost
//! cap, which the executor never lets it pass. So the runs in flight can together spend no more
//! than is left, however many there are. When a run ends its cost is spent and its hold freed.
//!
//! A run's worst case is its own cost cap (the request's `x-baton-max-cost-usd`, or the pool's
//! `[budget] max_cost_usd`) where it has one; otherwise [`worst_run_cost`]. A run whose worst
//! case does not fit in what is free holds what is free, and is capped at it (it may then fail
//! with `budget_exceeded`); with nothing free it is refused with 429.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use baton_engine::Executor;
use baton_providers::ProviderKind;

use crate::request::Call;

/// Today's figures: the day (days since 1970, UTC), what was spent, and what runs hold.
#[derive(Debug, Default)]
pub(crate) struct Today {
    pub(crate) day: u64,
    pub(crate) spent: f64,
    pub(crate) held: f64,
}

/// The server's day, shared with the holds of the runs in flight.
#[derive(Debug, Clone, Default)]
pub(crate) struct Day(Arc<Mutex<Today>>);

impl Day {
    /// Today's figures; a new day starts at nothing spent (holds of runs that began yesterday
    /// are kept: they are still in flight).
    pub(crate) fn today(&self, now_day: u64) -> MutexGuard<'_, Today> {
        let mut t = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if t.day != now_day {
            t.day = now_day;
            t.spent = 0.0;
        }
        t
    }

    /// Holds `amount` of the day for a run until the hold is dropped.
    pub(crate) fn hold(&self, today: &mut Today, amount: f64) -> DayHold {
        today.held += amount;
        DayHold { day: self.clone(), amount }
    }
}

/// A run's hold on the day, freed when the run ends (the hold is dropped with it).
#[derive(Debug)]
pub(crate) struct DayHold {
    day: Day,
    amount: f64,
}

impl DayHold {
    pub(crate) fn amount(&self) -> f64 {
        self.amount
    }
}

impl Drop for DayHold {
    fn drop(&mut self) {
        let mut t = self.day.0.lock().unwrap_or_else(PoisonError::into_inner);
        t.held = (t.held - self.amount).max(0.0);
    }
}

/// Input tokens allowed for what a step sees beside the question and the earlier answers (its
/// system prompt and subtask), and for a conductor's prompt (its descriptions, measured lines
/// and examples) beside the question: generous, since a bound that is too low would cut runs.
const STEP_PROMPT_TOKENS: u64 = 1_024;
const CONDUCTOR_PROMPT_TOKENS: u64 = 16_384;

/// The most a run of `call` can cost when nothing caps it, at the dearest price that could
/// apply to each call: every step (`max_steps`, or the recursion's step limit) on the dearest
/// worker, its input the question, the conversation and every earlier step's output cap, its
/// output the largest output cap; the conductor's plan and one retry of it, where the
/// conductor is priced; every call times its allowed attempts. A worker or conductor nobody
/// prices counts $0 here, as it does against every cap (its cost cannot be known).
pub(crate) fn worst_run_cost(executor: &Executor, call: &Call) -> f64 {
    let options = executor.options();
    let attempts = f64::from(options.retry.max_retries) + 1.0;
    let asked = call.question.len()
        + call.instructions.as_ref().map_or(0, String::len)
        + call.history.iter().map(|m| m.content.len()).sum::<usize>();
    // No tokenizer makes more tokens than bytes.
    let input0 = asked as u64;
    let workers: Vec<&baton_engine::executor::Worker> = match call.worker {
        Some(w) => executor.workers().get(w).into_iter().collect(),
        None => executor.workers().iter().collect(),
    };
    let output = workers.iter().map(|w| u64::from(w.output_cap)).max().unwrap_or(0);
    let steps = match call.worker {
        Some(_) => 1,
        None if options.recursion.enabled => {
            options.recursion.max_total_steps.unwrap_or(2 * options.max_steps).max(options.max_steps)
        }
        None => options.max_steps,
    };
    let mut total = 0.0;
    for k in 0..steps as u64 {
        let input = input0 + STEP_PROMPT_TOKENS + k * output;
        total += workers.iter().filter_map(|w| w.pricing.worst_case(input, output)).fold(0.0, f64::max);
    }
    let conductor = &options.conductor;
    if call.worker.is_none()
        && let (Some(url), Some(model)) = (&conductor.url, &conductor.model)
    {
        let pricing = baton_engine::prices::lookup(ProviderKind::OpenAiCompatible, url, model);
        let plan = pricing
            .worst_case(input0 + CONDUCTOR_PROMPT_TOKENS, u64::from(baton_engine::planner::REMOTE_PLAN_MAX_TOKENS));
        // The question's plan, and a second one where the first cannot be used.
        total += 2.0 * plan.unwrap_or(0.0);
    }
    total * attempts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_add_up_and_free_when_dropped_and_a_new_day_starts_at_nothing_spent() {
        let day = Day::default();
        let first = {
            let mut t = day.today(10);
            t.spent = 0.5;
            day.hold(&mut t, 0.25)
        };
        let second = day.hold(&mut day.today(10), 0.125);
        assert_eq!(day.today(10).held, 0.375);
        drop(first);
        assert_eq!(day.today(10).held, 0.125);
        assert_eq!(second.amount(), 0.125);
        let t = day.today(11);
        assert_eq!((t.spent, t.held), (0.0, 0.125), "yesterday's run still holds its room");
    }

    #[test]
    fn a_runs_worst_case_is_every_step_on_the_dearest_worker_times_its_attempts() {
        let text = "max_steps = 3\n[retry]\nmax_retries = 1\n\n\
            [[worker]]\nname = \"cheap\"\nprovider = \"openai\"\nmodel = \"m\"\nmax_tokens = 100\nprice_in = 1.0\nprice_out = 1.0\n\n\
            [[worker]]\nname = \"dear\"\nprovider = \"openai\"\nmodel = \"m\"\nmax_tokens = 50\nprice_in = 10.0\nprice_out = 10.0\n";
        let pool = baton_engine::Pool::parse(text, "pool.toml").expect("pool");
        let executor = Executor::from_pool(&pool);
        let mut call = Call::for_tests();
        call.question = "x".repeat(1000);
        // Output 100 (the largest cap); inputs 1000 + 1024 (+ 100 per earlier step), at $10/M.
        let steps: f64 = (0..3).map(|k| ((1000 + 1024 + k * 100) + 100) as f64 * 10.0 / 1e6).sum();
        let worst = worst_run_cost(&executor, &call);
        assert!((worst - 2.0 * steps).abs() < 1e-9, "{worst} against {}", 2.0 * steps);
        call.worker = Some(0);
        let alone = ((1000 + 1024) + 100) as f64 * 1.0 / 1e6 * 2.0;
        assert!((worst_run_cost(&executor, &call) - alone).abs() < 1e-9, "one step on the cheap worker");
    }
}
