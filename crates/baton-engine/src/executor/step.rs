//! One step given to a worker: the conversation it is sent, then its call: a slot at its
//! endpoint, the budget reserved before each attempt and settled after, retries with the pool's
//! backoff, its time limit, and its text streamed as `StepDelta`s.

use std::time::{Duration, Instant};

use baton_plan::Plan;
use baton_providers::{ChatModel, ChatRequest, ErrorKind, Message, ProviderError, Usage};

use super::{EventSink, Executor, RunCtx};
use crate::accounting::{Caller, Refused, Reservation, WorstCase};
use crate::event::{RunEvent, StepError, StepRef};

pub(super) struct StepDone {
    pub(super) output: String,
    pub(super) usage: Usage,
    pub(super) cost_usd: Option<f64>,
    pub(super) latency: Duration,
    pub(super) retries: u32,
}

pub(super) enum StepFailure {
    Provider(ProviderError),
    /// A budget cap was reached before a call; the message says which.
    Budget(String),
    /// The run is stopping (cancelled, or another step hit a cap).
    Stopped,
    /// The conductor could not write a usable plan.
    Conductor(String),
    RecursionLimit(String),
}

impl StepFailure {
    pub(super) fn message(&self) -> String {
        match self {
            StepFailure::Provider(e) => e.message.clone(),
            StepFailure::Budget(m) | StepFailure::Conductor(m) | StepFailure::RecursionLimit(m) => m.clone(),
            StepFailure::Stopped => "the run stopped".to_owned(),
        }
    }
}

impl Executor {
    /// Step `i` of `plan`'s system message and conversation: `prefix` (the work handed to its
    /// round), a subtask/answer pair for each step it sees (`seen`: step number and output),
    /// then its own instruction.
    pub(super) fn step_conversation(
        &self,
        ctx: &RunCtx<'_>,
        plan: &Plan,
        i: usize,
        depth: u32,
        prefix: &[Message],
        seen: &[(usize, &str)],
    ) -> (Option<String>, Vec<Message>) {
        let mut messages = prefix.to_vec();
        for &(j, output) in seen {
            messages.push(Message::user(plan.steps[j].subtask.clone()));
            messages.push(Message::assistant(output.to_owned()));
        }
        let answers = i + 1 == plan.steps.len();
        let worker = plan.steps[i].model_id;
        let subtask = &plan.steps[i].subtask;
        let replies = answers && depth == 0 && worker < self.workers.len();
        // The step that replies is asked the question itself, its subtask being its part, so a
        // narrowed subtask cannot drop what was asked.
        let asked = replies
            && self.options.question_to_answer_step
            && !crate::plan_check::holds_question(subtask, &ctx.question);
        let system = worker_system(self.options.show_question, asked.then_some(subtask.as_str()), ctx);
        messages.push(Message::user(if asked {
            crate::fallback::alone_subtask(&ctx.history, &ctx.question)
        } else {
            subtask.clone()
        }));
        (system, messages)
    }

    /// The request a step sends its worker, the most it can use, and whether that worst case's
    /// input is the prompt's exact token count (a local model's): the same for every attempt,
    /// since the messages do not change between retries. The step that answers takes the run's
    /// answer settings.
    pub(super) async fn step_request(
        &self,
        ctx: &RunCtx<'_>,
        worker_index: usize,
        system: Option<String>,
        messages: Vec<Message>,
        answers: bool,
    ) -> (ChatRequest, WorstCase, bool) {
        let worker = &self.workers[worker_index];
        let mut request = ChatRequest { system, messages, ..ChatRequest::default() };
        let mut output_cap = worker.output_cap;
        if answers {
            let a = ctx.answer;
            request.max_tokens = a.max_tokens.map(|m| m.min(worker.output_cap));
            output_cap = request.max_tokens.unwrap_or(output_cap);
            (request.temperature, request.top_p) = (a.temperature, a.top_p);
        }
        // A model that counts its input exactly (a local one) is reserved for that, not for
        // its bytes.
        let (worst, exact) = match worker.model.input_tokens(&request).await {
            Some(input) => (WorstCase::of_size(input, u64::from(output_cap), &worker.pricing), true),
            None => (WorstCase::of(request.system.as_deref(), &request.messages, output_cap, &worker.pricing), false),
        };
        (request, worst, exact)
    }

    /// A step given to a worker: wait for a slot at its endpoint, then call with retries.
    pub(super) async fn run_step(
        &self,
        ctx: &RunCtx<'_>,
        at: StepRef,
        worker_index: usize,
        system: Option<String>,
        messages: Vec<Message>,
        answers: bool,
    ) -> (usize, Result<StepDone, StepFailure>) {
        let StepRef { round, step } = at;
        let worker = &self.workers[worker_index];
        let permit = match self.limits.get(&worker.endpoint) {
            Some(limit) => tokio::select! {
                biased;
                () = ctx.stop.cancelled() => return (step, Err(StepFailure::Stopped)),
                permit = limit.clone().acquire_owned() => permit.ok(),
            },
            None => None,
        };
        let _permit = permit;
        ctx.emit(RunEvent::StepStarted {
            round,
            step,
            worker: worker_index,
            system: system.clone(),
            messages: messages.clone(),
        });
        let started = Instant::now();
        let (request, worst, exact) = self.step_request(ctx, worker_index, system, messages, answers).await;
        // Every attempt's usage, failed ones included: the step's figures are what it cost.
        let mut spent = Usage::default();
        let mut cost = Some(0.0);
        let mut retries = 0;
        loop {
            let reservation =
                match ctx.ledger.reserve(Caller::Worker, &worker.info.name, worst, &worker.pricing, &ctx.stop).await {
                    Ok(reservation) => reservation,
                    Err(Refused::Stopped) => return (step, Err(StepFailure::Stopped)),
                    Err(Refused::Exceeded(e)) => return (step, Err(StepFailure::Budget(e.message))),
                };
            // The reservation keeps what the provider reported and the text that came: a call
            // cut short (an error, the timeout below, a stop) is billed for what it read and sent.
            // From here the request goes out, so its input counts even if nothing comes back
            // (a server may bill a prompt it read); a connection never made does not.
            reservation.sent(exact);
            let attempt = tokio::time::timeout(
                worker.timeout,
                attempt(worker.model.as_ref(), request.clone(), round, step, ctx.events, &reservation),
            );
            let result = tokio::select! {
                biased;
                () = ctx.stop.cancelled() => None,
                result = attempt => Some(result.unwrap_or_else(|_| {
                    Err(ProviderError::new(
                        ErrorKind::Timeout,
                        format!("no complete answer within {} s", worker.timeout.as_secs_f64()),
                    ))
                })),
            };
            let Some(result) = result else {
                reservation.settle_cut(None);
                return (step, Err(StepFailure::Stopped));
            };
            let (usage, call_cost) = match &result {
                Ok((_, usage)) => {
                    let call_cost = worker.pricing.cost(usage);
                    reservation.settle(*usage, call_cost);
                    (*usage, call_cost)
                }
                Err(error) => reservation.settle_failed(error),
            };
            spent += usage;
            cost = cost.zip(call_cost).map(|(a, b)| a + b);
            match result {
                Ok((output, _)) => {
                    let latency = started.elapsed();
                    return (step, Ok(StepDone { output, usage: spent, cost_usd: cost, latency, retries }));
                }
                Err(error) => {
                    retries += 1;
                    let Some(delay) = self.options.retry.delay(retries, &error) else {
                        return (step, Err(StepFailure::Provider(error)));
                    };
                    ctx.emit(RunEvent::StepRetrying {
                        round,
                        step,
                        attempt: retries,
                        error: StepError { kind: error.kind.into(), message: error.message, status: error.status },
                        delay_ms: delay.as_millis() as u64,
                    });
                    tokio::select! {
                        biased;
                        () = ctx.stop.cancelled() => return (step, Err(StepFailure::Stopped)),
                        () = tokio::time::sleep(delay) => {}
                    }
                }
            }
        }
    }
}

/// A worker's system message: Baton's step instructions (the question, when the pool shows it;
/// the step's part, for a step asked the question itself), then the client's own instructions,
/// if any.
fn worker_system(show_question: bool, part: Option<&str>, ctx: &RunCtx<'_>) -> Option<String> {
    let question = show_question
        .then(|| format!("You are one step of a larger workflow. The user's original question:\n\n{}", ctx.question));
    let part = part.map(|p| format!("Your part in this workflow: {p}"));
    let step = match (question, part) {
        (Some(q), Some(p)) => Some(format!("{q}\n\n{p}")),
        (q, p) => q.or(p),
    };
    match (step, &ctx.instructions) {
        (Some(step), Some(theirs)) => Some(format!("{step}\n\nThe user's instructions:\n\n{theirs}")),
        (step, theirs) => step.or_else(|| theirs.clone()),
    }
}

/// One call: stream the answer, forwarding text as it comes.
async fn attempt(
    model: &dyn ChatModel,
    request: ChatRequest,
    round: u32,
    step: usize,
    events: &EventSink,
    reservation: &Reservation<'_>,
) -> Result<(String, Usage), ProviderError> {
    let mut forward = |text: &str| {
        reservation.received(text.len());
        let _ = events.send(RunEvent::StepDelta { round, step, text: text.to_owned() });
    };
    let answer = baton_providers::read_answer(model, request, &mut forward, reservation.reported()).await?;
    // An empty answer would reach dependent steps as an empty assistant turn, which providers
    // reject; say why here instead.
    if answer.text.trim().is_empty() {
        let stop = answer.stop_reason.unwrap_or_else(|| "none given".to_owned());
        return Err(ProviderError::new(
            ErrorKind::EmptyAnswer,
            format!(
                "the model finished without any text (stop reason: {stop}); if it ran out of tokens, raise max_tokens or lower thinking_budget"
            ),
        )
        .with_usage(Some(answer.usage)));
    }
    Ok((answer.text, answer.usage))
}
