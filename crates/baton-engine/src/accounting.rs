//! What a run spends, and the caps that bound it.
//!
//! Every request a run sends goes through one [`Ledger`]: the workers' calls, their retries and
//! failed attempts, and the conductor's own calls (local or remote). Before a call, the ledger
//! *reserves* the call's worst case — its input bounded by its UTF-8 bytes (no tokenizer yields
//! more tokens than bytes) plus an allowance per message, or counted exactly where the model
//! holds its tokenizer (a local model: `ChatModel::input_tokens`, and the local conductor, whose
//! prompt's bytes are about four times its tokens), its output by the call's token cap,
//! both priced — and refuses a call that would not fit. When the call ends it is *settled* to
//! what the provider reported, and the reservation is released. So the totals of a run never pass
//! a cap, however many steps run at once: a call is only made when the spent figures, plus every
//! call still in flight at its worst, plus this call at its worst, fit.
//!
//! A call that fits only once calls in flight settle waits for them instead of failing; one that
//! would not fit even then fails its step with `budget`.
//!
//! A call may also be *held* for ([`Ledger::hold`]) before it is made: the room a fallback
//! answer needs is held while the conductor plans, so planning can never spend it.
//!
//! A call that ends without a usage report (an error, a time-out, a stop) is settled to an
//! upper estimate of what it sent and received: see [`Reservation`].
//!
//! The figures are kept per caller ([`Caller`]): the conductor's apart from the workers', so
//! every surface can show what orchestration cost next to what the work cost.

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use baton_providers::Message;
/// `Figures` counts tokens in the providers' own shape; re-exported so a reader of figures
/// needs no provider crate.
pub use baton_providers::Usage;
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::prices::Pricing;

/// Caps per run, checked before every call (the pool file's `[budget]` table).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct Budget {
    /// Provider calls, retries included.
    pub max_calls: Option<u32>,
    /// Input plus output tokens.
    pub max_tokens: Option<u64>,
    pub max_cost_usd: Option<f64>,
}

/// Tokens allowed for each message's framing (role markers, the chat template) on top of its
/// bytes, and once more for the request's own framing. Chat templates use a handful per turn.
pub const FRAMING_TOKENS: u64 = 16;

/// Who made a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Caller {
    /// The conductor writing a plan (a retry after an unusable plan is a call too).
    Conductor,
    /// A worker answering a step.
    Worker,
}

/// Calls, tokens and dollars: for a whole run, its conductor, or its workers. One shape, read
/// by every surface (CLI, `--json`, app, history, exports).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ts_rs::TS)]
pub struct Figures {
    /// Requests sent, retries and failed attempts included.
    pub calls: u32,
    pub usage: Usage,
    /// Sum over calls with a known price.
    pub cost_usd: f64,
    /// False when some call's price is unknown, so `cost_usd` is a lower bound.
    pub cost_complete: bool,
}

impl Default for Figures {
    fn default() -> Self {
        Figures { calls: 0, usage: Usage::default(), cost_usd: 0.0, cost_complete: true }
    }
}

impl Figures {
    /// Adds what a call (or a plan's calls) used and cost, `None` for an unknown price; the
    /// calls themselves are counted by whoever makes them.
    pub fn add(&mut self, usage: Usage, cost: Option<f64>) {
        self.usage += usage;
        match cost {
            Some(c) => self.cost_usd += c,
            None => self.cost_complete = false,
        }
    }

    /// The dollars, when every call's price is known.
    pub fn cost(&self) -> Option<f64> {
        self.cost_complete.then_some(self.cost_usd)
    }

    /// Both sides together.
    pub fn plus(&self, other: &Figures) -> Figures {
        let mut usage = self.usage;
        usage += other.usage;
        Figures {
            calls: self.calls + other.calls,
            usage,
            cost_usd: self.cost_usd + other.cost_usd,
            cost_complete: self.cost_complete && other.cost_complete,
        }
    }
}

impl Figures {
    /// One line for people, the same on every surface: "4 calls · 1200 in (800 cached) / 300
    /// out tokens · $0.0123"; a cost that misses unpriced calls reads "≥ $…".
    pub fn summary(&self) -> String {
        let u = &self.usage;
        let mut input = format!("{} in", u.input_tokens);
        match (u.cached_input_tokens, u.cache_write_input_tokens) {
            (0, 0) => {}
            (read, 0) => input.push_str(&format!(" ({read} cached)")),
            (read, written) => input.push_str(&format!(" ({read} cached, {written} written to cache)")),
        }
        let calls = if self.calls == 1 { "1 call".to_owned() } else { format!("{} calls", self.calls) };
        let cost =
            if self.cost_complete { format!("${:.4}", self.cost_usd) } else { format!("≥ ${:.4}", self.cost_usd) };
        let estimated = if u.estimated { " (partly estimated: a call was cut off before its usage came)" } else { "" };
        format!("{calls} · {input} / {} out tokens · {cost}{estimated}", u.output_tokens)
    }
}

/// The most one call can use.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WorstCase {
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// `None` when the caller's price is unknown (the call then reserves no dollars, and the
    /// run's cost is reported incomplete).
    pub cost_usd: Option<f64>,
}

impl WorstCase {
    /// The worst case of a call sending `system` and `messages` with at most `output_cap`
    /// output tokens, priced by `pricing`.
    pub fn of(system: Option<&str>, messages: &[Message], output_cap: u32, pricing: &Pricing) -> Self {
        let bytes = system.map_or(0, str::len) + messages.iter().map(|m| m.content.len()).sum::<usize>();
        let turns = messages.len() as u64 + u64::from(system.is_some()) + 1;
        Self::of_size(bytes as u64 + turns * FRAMING_TOKENS, u64::from(output_cap), pricing)
    }

    /// A call whose input is at most `input_tokens` and output at most `output_tokens`.
    pub fn of_size(input_tokens: u64, output_tokens: u64, pricing: &Pricing) -> Self {
        WorstCase { input_tokens, output_tokens, cost_usd: pricing.worst_case(input_tokens, output_tokens) }
    }

    pub fn tokens(&self) -> u64 {
        self.input_tokens + self.output_tokens
    }
}

/// Which cap refused a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cap {
    Calls,
    Tokens,
    Cost,
}

/// A call that would not fit under a cap, even once every call in flight has settled.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct BudgetExceeded {
    pub cap: Cap,
    /// Names the cap and the figures: spent, held by calls in flight, and what this call could use.
    pub message: String,
}

/// Why [`Ledger::reserve`] gave no reservation.
#[derive(Debug, Clone, PartialEq)]
pub enum Refused {
    Exceeded(BudgetExceeded),
    /// The run stopped while the call waited for room.
    Stopped,
}

/// The run's figures so far, split by caller.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Spent {
    pub conductor: Figures,
    pub workers: Figures,
    /// Who made calls without a known price, by name (worker names; "the conductor").
    pub cost_unknown_for: Vec<String>,
}

impl Spent {
    pub fn total(&self) -> Figures {
        self.conductor.plus(&self.workers)
    }
}

/// Counts every call of one run against its [`Budget`].
#[derive(Debug)]
pub struct Ledger {
    budget: Budget,
    inner: Mutex<Inner>,
    /// Woken whenever a call settles, for calls waiting for room.
    settled: Notify,
}

#[derive(Debug, Default)]
struct Inner {
    conductor: Figures,
    workers: Figures,
    unknown: BTreeSet<String>,
    /// Held by calls in flight.
    reserved_tokens: u64,
    reserved_cost: f64,
    in_flight: u32,
    /// Held by [`Hold`]s: calls not yet made, whose room no other call may take.
    held_tokens: u64,
    held_cost: f64,
    held_calls: u32,
}

impl Inner {
    fn side(&mut self, caller: Caller) -> &mut Figures {
        match caller {
            Caller::Conductor => &mut self.conductor,
            Caller::Worker => &mut self.workers,
        }
    }

    fn calls(&self) -> u32 {
        self.conductor.calls + self.workers.calls
    }

    fn tokens(&self) -> u64 {
        self.conductor.usage.total() + self.workers.usage.total()
    }

    fn cost(&self) -> f64 {
        self.conductor.cost_usd + self.workers.cost_usd
    }
}

/// Whether a reservation may be made now, later, or never.
enum Fit {
    Now,
    /// Would fit once the calls in flight settle (for less than their worst case, or at all).
    Later,
    Never(BudgetExceeded),
}

impl Ledger {
    pub fn new(budget: Budget) -> Self {
        Ledger { budget, inner: Mutex::default(), settled: Notify::new() }
    }

    /// The output tokens a call with at most `input_tokens` of input could reserve now,
    /// under the token cap; `None` without one. For a caller that sets its own output cap
    /// (the local conductor, whose grammar's bound is far above any real plan).
    pub fn output_room(&self, input_tokens: u64) -> Option<u64> {
        let max = self.budget.max_tokens?;
        let l = self.lock();
        Some(max.saturating_sub(l.tokens() + l.held_tokens + l.reserved_tokens + input_tokens))
    }

    /// Whether the run has any cap (without one, nothing needs holding).
    pub fn capped(&self) -> bool {
        self.budget != Budget::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Held room never frees while a call waits (its holder waits on that call), so a call
    /// that fits only without it never fits.
    fn fit(&self, l: &Inner, who: &str, worst: &WorstCase) -> Fit {
        let held = |what: String| {
            if l.held_calls == 0 {
                String::new()
            } else {
                format!(", and {what} held back for the answer of one worker alone if no plan can be used")
            }
        };
        if let Some(max) = self.budget.max_calls
            && l.calls() + l.held_calls >= max
        {
            let message = format!(
                "budget cap reached: {} of at most {max} calls made{}",
                l.calls(),
                held(format!("{} call", l.held_calls))
            );
            return Fit::Never(BudgetExceeded { cap: Cap::Calls, message });
        }
        let mut later = false;
        if let Some(max) = self.budget.max_tokens {
            let spent = l.tokens();
            if spent.saturating_add(l.held_tokens).saturating_add(worst.tokens()) > max {
                let message = format!(
                    "budget cap reached: a call to {who} could use up to {} tokens ({} in, {} out), and {spent} of at most {max} tokens are used{}",
                    worst.tokens(),
                    worst.input_tokens,
                    worst.output_tokens,
                    held(format!("{} are", l.held_tokens))
                );
                return Fit::Never(BudgetExceeded { cap: Cap::Tokens, message });
            }
            later |= spent + l.held_tokens + l.reserved_tokens + worst.tokens() > max;
        }
        if let Some(max) = self.budget.max_cost_usd {
            let call = worst.cost_usd.unwrap_or(0.0);
            let spent = l.cost();
            if spent + l.held_cost + call > max {
                let message = format!(
                    "budget cap reached: a call to {who} could cost up to ${call:.4}, and ${spent:.4} of at most ${max:.4} is spent{}",
                    held(format!("${:.4} is", l.held_cost))
                );
                return Fit::Never(BudgetExceeded { cap: Cap::Cost, message });
            }
            later |= spent + l.held_cost + l.reserved_cost + call > max;
        }
        if later { Fit::Later } else { Fit::Now }
    }

    /// Holds the room of a call to be made later, if it could be made now: until the hold is
    /// dropped, other calls fit only beside it. Dropping it makes nothing and counts nothing;
    /// the held call, when it is made, reserves as any other.
    pub fn hold(&self, who: &str, worst: WorstCase) -> Result<Hold<'_>, BudgetExceeded> {
        let mut l = self.lock();
        if let Fit::Never(exceeded) = self.fit(&l, who, &worst) {
            return Err(exceeded);
        }
        let cost = worst.cost_usd.unwrap_or(0.0);
        l.held_calls += 1;
        l.held_tokens += worst.tokens();
        l.held_cost += cost;
        Ok(Hold { ledger: self, tokens: worst.tokens(), cost })
    }

    /// Reserves a call's worst case, waiting while it fits only once calls in flight settle.
    /// The call counts from here on, made or not.
    pub async fn reserve(
        &self,
        caller: Caller,
        who: &str,
        worst: WorstCase,
        pricing: &Pricing,
        stop: &CancellationToken,
    ) -> Result<Reservation<'_>, Refused> {
        loop {
            // Registered before the check, so a settlement between the check and the wait
            // still wakes this call.
            let settled = self.settled.notified();
            tokio::pin!(settled);
            settled.as_mut().enable();
            match self.try_reserve(caller, who, worst, pricing) {
                Ok(reservation) => return Ok(reservation),
                Err(Some(exceeded)) => return Err(Refused::Exceeded(exceeded)),
                Err(None) => {}
            }
            tokio::select! {
                biased;
                () = stop.cancelled() => return Err(Refused::Stopped),
                () = settled => {}
            }
        }
    }

    /// Reserves a call's worst case now: `Err(None)` when it would fit only after calls in
    /// flight settle, `Err(Some(_))` when it will not fit.
    pub fn try_reserve(
        &self,
        caller: Caller,
        who: &str,
        worst: WorstCase,
        pricing: &Pricing,
    ) -> Result<Reservation<'_>, Option<BudgetExceeded>> {
        let mut l = self.lock();
        match self.fit(&l, who, &worst) {
            Fit::Never(exceeded) => return Err(Some(exceeded)),
            // With nothing in flight, waiting would never end; `fit` cannot say Later then.
            Fit::Later if l.in_flight > 0 => return Err(None),
            Fit::Later | Fit::Now => {}
        }
        l.side(caller).calls += 1;
        l.in_flight += 1;
        l.reserved_tokens += worst.tokens();
        let cost = worst.cost_usd.unwrap_or(0.0);
        l.reserved_cost += cost;
        Ok(Reservation {
            ledger: self,
            caller,
            who: who.to_owned(),
            worst,
            pricing: pricing.clone(),
            cost,
            settled: false,
            progress: Progress::default(),
        })
    }

    fn settle(&self, r: &Reservation<'_>, usage: Usage, cost: Option<f64>) {
        {
            let mut l = self.lock();
            l.in_flight -= 1;
            l.reserved_tokens -= r.worst.tokens();
            l.reserved_cost = (l.reserved_cost - r.cost).max(0.0);
            if cost.is_none() {
                l.unknown.insert(r.who.clone());
            }
            l.side(r.caller).add(usage, cost);
        }
        self.settled.notify_waiters();
    }

    /// The figures so far.
    pub fn spent(&self) -> Spent {
        let l = self.lock();
        Spent {
            conductor: l.conductor.clone(),
            workers: l.workers.clone(),
            cost_unknown_for: l.unknown.iter().cloned().collect(),
        }
    }
}

/// Room held for a call not yet made ([`Ledger::hold`]); dropping it frees the room.
#[derive(Debug)]
pub struct Hold<'a> {
    ledger: &'a Ledger,
    tokens: u64,
    cost: f64,
}

impl Drop for Hold<'_> {
    fn drop(&mut self) {
        {
            let mut l = self.ledger.lock();
            l.held_calls -= 1;
            l.held_tokens -= self.tokens;
            l.held_cost = (l.held_cost - self.cost).max(0.0);
        }
        self.ledger.settled.notify_waiters();
    }
}

/// What a call in flight is known to have used, for a call that ends without its usage.
#[derive(Debug, Default)]
struct Progress {
    /// The usage the provider reported so far.
    reported: Mutex<Usage>,
    /// Bytes of answer text received.
    received: AtomicU64,
    /// The request went out: its input counts, whatever comes back.
    sent: AtomicBool,
    /// ... and the worst case's input is its exact count, not a bound.
    sent_exact: AtomicBool,
}

/// A call's reserved worst case. Settle it with what the call used; a call that ends without
/// a usage report ([`Reservation::settle_cut`]), or whose future is dropped unsettled (a stopped
/// run, a time-out), counts an upper estimate from what its caller told the reservation along
/// the way: the usage reported so far ([`Reservation::reported`]), the text received
/// ([`Reservation::received`]) and whether the request went out ([`Reservation::sent`]), the
/// same estimate a worker's cut stream gets (`Usage::estimate_cut_call`).
#[derive(Debug)]
pub struct Reservation<'a> {
    ledger: &'a Ledger,
    caller: Caller,
    who: String,
    worst: WorstCase,
    pricing: Pricing,
    cost: f64,
    settled: bool,
    progress: Progress,
}

impl Reservation<'_> {
    /// Records the call's real usage and price (`None`: unknown) and frees its reservation.
    pub fn settle(mut self, usage: Usage, cost: Option<f64>) {
        self.settled = true;
        self.ledger.settle(&self, usage, cost);
    }

    /// Settles a call that ended without its usage (an error, a time-out, a stop) to the
    /// estimate, from `reported` when its error carried the usage so far, else from what the
    /// reservation was told; returns what it settled: the usage and its price.
    pub fn settle_cut(mut self, reported: Option<Usage>) -> (Usage, Option<f64>) {
        if let Some(usage) = reported {
            *self.progress.reported.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = usage;
        }
        self.settle_estimate()
    }

    /// Settles a failed call: as [`Reservation::settle_cut`] where the provider may bill for it
    /// (the request went out, and no error status refused it), else for what it reported
    /// alone (a connection never made, an error answer: nothing of the prompt counts).
    pub fn settle_failed(self, error: &baton_providers::ProviderError) -> (Usage, Option<f64>) {
        if !error.may_be_billed() {
            self.progress.sent.store(false, Ordering::SeqCst);
        }
        self.settle_cut(error.usage)
    }

    /// Where the call keeps the usage its provider reports as it goes (for
    /// `baton_providers::read_answer`).
    pub fn reported(&self) -> &Mutex<Usage> {
        &self.progress.reported
    }

    /// Counts `bytes` more of answer text received.
    pub fn received(&self, bytes: usize) {
        self.progress.received.fetch_add(bytes as u64, Ordering::SeqCst);
    }

    /// The request has gone out: from here its input counts even if nothing comes back (a
    /// local model has begun reading its prompt; a server may bill a prompt it read). `exact`
    /// when the worst case's input is the prompt's real token count.
    pub fn sent(&self, exact: bool) {
        self.progress.sent_exact.store(exact, Ordering::SeqCst);
        self.progress.sent.store(true, Ordering::SeqCst);
    }

    /// The upper estimate of what a call that ended without its usage used.
    fn estimate(&self) -> Usage {
        let p = &self.progress;
        let reported = *p.reported.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let received = p.received.load(Ordering::SeqCst);
        let mut usage = reported.estimate_cut_call(received, self.worst.input_tokens, self.worst.output_tokens);
        if p.sent.load(Ordering::SeqCst) && usage.input_tokens == 0 {
            usage.input_tokens = self.worst.input_tokens;
            usage.estimated |= !p.sent_exact.load(Ordering::SeqCst);
        }
        usage
    }

    fn settle_estimate(&mut self) -> (Usage, Option<f64>) {
        self.settled = true;
        let usage = self.estimate();
        let cost = self.pricing.cost(&usage);
        self.ledger.settle(self, usage, cost);
        (usage, cost)
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if !self.settled {
            self.settle_estimate();
        }
    }
}

/// What a planner charges its calls to: the run's ledger, as the conductor, and the run's
/// stop token (a call waiting for room stops with the run).
#[derive(Debug, Clone, Copy)]
pub struct Meter<'a> {
    pub ledger: &'a Ledger,
    pub stop: &'a CancellationToken,
}

impl<'a> Meter<'a> {
    /// See [`Ledger::output_room`].
    pub fn output_room(&self, input_tokens: u64) -> Option<u64> {
        self.ledger.output_room(input_tokens)
    }

    pub async fn reserve(&self, who: &str, worst: WorstCase, pricing: &Pricing) -> Result<Reservation<'a>, Refused> {
        self.ledger.reserve(Caller::Conductor, who, worst, pricing, self.stop).await
    }
}

/// A meter with no caps and no stop, for planning outside a run (tests, benchmarks). Its
/// figures are kept nowhere anyone reads.
pub fn unmetered() -> Meter<'static> {
    static LEDGER: std::sync::LazyLock<Ledger> = std::sync::LazyLock::new(|| Ledger::new(Budget::default()));
    static NEVER: std::sync::LazyLock<CancellationToken> = std::sync::LazyLock::new(CancellationToken::new);
    Meter { ledger: &LEDGER, stop: &NEVER }
}

#[cfg(test)]
mod tests;
