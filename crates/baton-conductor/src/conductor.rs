//! Conductors: a local model that writes plans under a grammar, or a remote OpenAI-compatible
//! endpoint whose answers are parsed (and retried once, with the error fed back).

use std::sync::Arc;
use std::time::Duration;

use baton_engine::accounting::{Figures, Meter, WorstCase};
use baton_engine::calls::{CallPolicy, with_retries};
use baton_engine::prices::Pricing;
use baton_engine::{PlanDeltas, Planned, Planner, PlannerError, PlanningContext, WorkerInfo};
use baton_providers::{
    ChatModel, ChatRequest, Constraint, ErrorKind, Message, ProviderError, ServerGrammar, Usage, read_answer,
};
use futures::future::BoxFuture;

use crate::grammar::PlanGrammar;
use crate::prompt::{PromptBuilder, PromptVersion};

/// How a conductor writes.
#[derive(Debug, Clone, PartialEq)]
pub struct ConductorOptions {
    /// Longest reasoning before the lists, in characters.
    pub max_reasoning_chars: usize,
    /// Longest subtask, in characters.
    pub max_subtask_chars: usize,
    /// `None` uses the model's generation defaults. The default, 0, is greedy decoding: the same
    /// question and pool give the same plan, so a plan can be reproduced and a run compared.
    pub temperature: Option<f64>,
    /// Whenever the conductor may pick itself, it must (tests drive recursion to its caps).
    pub force_self: bool,
    /// Leave the few-shot workflows out of the prompt.
    pub no_examples: bool,
    /// Which prompt the conductor is given (`[conductor] prompt`).
    pub prompt_version: PromptVersion,
    /// Plans that were right when the pool learned: examples for the questions they fit.
    pub learned: Vec<baton_engine::learned::LearnedPlan>,
    /// Longest a plan may take, from the request to its last token (retries included).
    pub plan_time_limit: Duration,
    /// A remote conductor's time limit per request and its retries: the workers' policy.
    pub call: CallPolicy,
}

/// The default for [`ConductorOptions::plan_time_limit`]: generous for a small model on a
/// laptop CPU (a plan there takes well under a minute), and still an answer, never a hang, when
/// a model is far too slow for the machine.
pub const DEFAULT_PLAN_TIME_LIMIT: Duration = Duration::from_secs(300);

impl Default for ConductorOptions {
    fn default() -> Self {
        ConductorOptions {
            max_reasoning_chars: PromptVersion::default().default_reasoning_chars(),
            max_subtask_chars: 600,
            temperature: Some(0.0),
            force_self: false,
            no_examples: false,
            prompt_version: PromptVersion::default(),
            learned: Vec::new(),
            plan_time_limit: DEFAULT_PLAN_TIME_LIMIT,
            call: CallPolicy::default(),
        }
    }
}

impl ConductorOptions {
    fn prompts(&self, workers: Vec<WorkerInfo>) -> PromptBuilder {
        let p = PromptBuilder::new(workers).with_version(self.prompt_version).with_learned(self.learned.clone());
        if self.no_examples { p.without_examples() } else { p }
    }
}

/// Runs `plan` within the plan time limit; past it, the error names the limit and the setting.
async fn within_time_limit<T>(
    limit: Duration,
    plan: impl std::future::Future<Output = Result<T, PlannerError>>,
) -> Result<T, PlannerError> {
    tokio::time::timeout(limit, plan).await.unwrap_or_else(|_| {
        Err(PlannerError::timed_out(format!(
            "the conductor did not finish its plan within the {} s time limit; use a smaller or faster conductor model (or a GPU build), or raise plan_time_limit_secs in the pool's [conductor] table",
            limit.as_secs_f64()
        )))
    })
}

/// The grammar for one planning request.
pub fn grammar_for(ctx: &PlanningContext, options: &ConductorOptions) -> PlanGrammar {
    let model_ids = if ctx.allow_self && options.force_self {
        vec![ctx.pool_size]
    } else {
        (0..ctx.pool_size + usize::from(ctx.allow_self)).collect()
    };
    PlanGrammar {
        model_ids,
        max_steps: ctx.max_steps,
        allow_stop: ctx.allow_stop,
        max_reasoning_chars: options.max_reasoning_chars,
        max_subtask_chars: options.max_subtask_chars,
    }
}

/// The fewest plan tokens a run's token cap may leave the local conductor; below this, the
/// plan is refused as over budget rather than started and cut.
const MIN_BUDGETED_PLAN_TOKENS: usize = 256;

/// A conductor running in process on a local model, constrained to valid plans.
#[cfg(feature = "local")]
pub struct LocalConductor {
    model: Arc<baton_local::LocalModel>,
    prompts: PromptBuilder,
    options: ConductorOptions,
}

#[cfg(feature = "local")]
impl std::fmt::Debug for LocalConductor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalConductor").field("model", &self.model).field("options", &self.options).finish()
    }
}

#[cfg(feature = "local")]
impl LocalConductor {
    pub fn new(model: Arc<baton_local::LocalModel>, workers: Vec<WorkerInfo>, options: ConductorOptions) -> Self {
        LocalConductor { model, prompts: options.prompts(workers), options }
    }

    /// Writes one plan and reports how fast (for `baton bench conductor`). Its one call is
    /// charged to `meter`: tokens count, dollars are zero.
    pub async fn plan_with_stats(
        &self,
        ctx: &PlanningContext,
        on_text: &mut (dyn FnMut(&str) + Send),
        meter: Meter<'_>,
    ) -> Result<(Planned, baton_local::Generated), PlannerError> {
        self.model.check_can_end_a_grammar().map_err(PlannerError::new)?;
        let grammar = grammar_for(ctx, &self.options);
        let system = self.prompts.system(ctx);
        let messages = self.prompts.messages(ctx);
        // The grammar's bound (its longest plan, in bytes: ~17k tokens for the defaults) is far
        // above any real plan. Under a run's token cap the plan gets the room that is left
        // instead, so a cap a user would set does not refuse every plan; one that runs into it
        // ends with stop reason `length`, which the error below names.
        let full = grammar.max_tokens();
        // The prompt's real tokens (its bytes, ~4 times as many, would leave a cap of a few
        // thousand tokens no room to plan in).
        let (input, exact) = match self.model.prompt_tokens(Some(&system), &messages).await {
            Some(tokens) => (tokens, true),
            None => (WorstCase::of(Some(&system), &messages, 0, &Pricing::Free).input_tokens, false),
        };
        let max_tokens = match meter.output_room(input) {
            Some(room) => full.min(usize::try_from(room).unwrap_or(usize::MAX).max(MIN_BUDGETED_PLAN_TOKENS)),
            None => full,
        };
        let options = baton_local::GenerateOptions {
            grammar: Some(grammar.to_lark()),
            max_tokens,
            temperature: self.options.temperature,
            top_p: None,
            complete_at: Some(crate::grammar::FENCE_CLOSE.to_owned()),
        };
        let output_cap = u32::try_from(options.max_tokens).unwrap_or(u32::MAX);
        let worst = WorstCase::of_size(input, u64::from(output_cap), &Pricing::Free);
        let reservation = meter.reserve("the conductor", worst, &Pricing::Free).await.map_err(PlannerError::refused)?;
        // mistral.rs reports no tokens for a generation that fails, times out or is stopped:
        // the reservation counts its prompt (read in full or in part) and the text it wrote.
        reservation.sent(exact);
        let mut counted = |t: &str| {
            reservation.received(t.len());
            on_text(t);
        };
        let generated = within_time_limit(self.options.plan_time_limit, async {
            self.model
                .generate(Some(&system), &messages, &options, &mut counted)
                .await
                .map_err(|e| PlannerError::new(e.message))
        })
        .await;
        match &generated {
            Ok(g) => reservation.settle(g.usage, Some(0.0)),
            Err(_) => drop(reservation.settle_cut(None)),
        }
        let generated = generated?;
        let plan = baton_plan::parse(&generated.text, &ctx.limits()).map_err(|e| {
            let budget = if max_tokens < full && generated.finish_reason.as_deref() == Some("length") {
                format!("; the run's token cap (budget.max_tokens) left room for only {max_tokens} tokens of plan")
            } else {
                String::new()
            };
            PlannerError::new(format!(
                "the constrained plan did not parse ({e}); stop reason {:?}{budget}",
                generated.finish_reason
            ))
        })?;
        let planned = Planned {
            raw: generated.text.clone(),
            plan,
            usage: generated.usage,
            cost_usd: Some(0.0),
            stop_reason: generated.finish_reason.clone(),
            prompt: Some(self.prompts.record(&system, &messages)),
            examples: self.prompts.shown_examples(ctx),
            routed: None,
        };
        Ok((planned, generated))
    }
}

#[cfg(feature = "local")]
impl Planner for LocalConductor {
    fn describe(&self) -> String {
        format!("{} (local, {})", self.model.path().display(), self.model.device)
    }

    fn plan<'a>(
        &'a self,
        ctx: PlanningContext,
        mut deltas: PlanDeltas<'a>,
        meter: Meter<'a>,
    ) -> BoxFuture<'a, Result<Planned, PlannerError>> {
        Box::pin(async move {
            let mut on_text = |t: &str| deltas(t);
            self.plan_with_stats(&ctx, &mut on_text, meter).await.map(|(planned, _)| planned)
        })
    }
}

/// The output cap of a remote conductor's calls: far above the longest plan the default
/// grammar admits, and what bounds the call's worst case for the run's budget.
pub const REMOTE_MAX_TOKENS: u32 = baton_engine::planner::REMOTE_PLAN_MAX_TOKENS;

/// The most text a remote conductor's answer may have: its output cap at 16 bytes a token,
/// far above any token's length. A server that ignores `max_tokens` would otherwise be read
/// without end (only the plan time limit stops it), the whole text kept in memory.
pub const REMOTE_MAX_PLAN_BYTES: usize = REMOTE_MAX_TOKENS as usize * 16;

/// A conductor behind an OpenAI-compatible endpoint (vLLM, SGLang, Ollama, llama.cpp).
pub struct RemoteConductor {
    model: Arc<dyn ChatModel>,
    name: String,
    prompts: PromptBuilder,
    options: ConductorOptions,
    /// The server's structured-output extension, when it has one the user named.
    grammar: Option<ServerGrammar>,
    pricing: Pricing,
}

impl std::fmt::Debug for RemoteConductor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteConductor").field("name", &self.name).finish_non_exhaustive()
    }
}

impl RemoteConductor {
    /// `name` describes the endpoint for people, e.g. `"qwen2.5-72b at http://gpu:8000/v1"`.
    pub fn new(model: Arc<dyn ChatModel>, name: String, workers: Vec<WorkerInfo>, options: &ConductorOptions) -> Self {
        RemoteConductor {
            model,
            name,
            prompts: options.prompts(workers),
            options: options.clone(),
            grammar: None,
            pricing: Pricing::Unknown,
        }
    }

    /// How the server's calls are priced (default: unknown, so a run reports its cost as
    /// incomplete rather than leaving the conductor out).
    pub fn with_pricing(mut self, pricing: Pricing) -> Self {
        self.pricing = pricing;
        self
    }

    /// Has the server hold every answer to the plan grammar, so a plan always parses (the
    /// parse-and-retry path stays as a safety net for servers that ignore the field).
    pub fn with_grammar(mut self, grammar: Option<ServerGrammar>) -> Self {
        self.grammar = grammar;
        self
    }

    fn constraint(&self, ctx: &PlanningContext) -> Option<Constraint> {
        let g = grammar_for(ctx, &self.options);
        Some(match self.grammar? {
            ServerGrammar::Vllm => Constraint::VllmRegex(g.to_regex()),
            ServerGrammar::Sglang => Constraint::SglangRegex(g.to_regex()),
            ServerGrammar::LlamaCpp => Constraint::LlamaCppGbnf(g.to_gbnf()),
        })
    }

    /// One request to the server, tried under the workers' time limit and retries; each
    /// attempt is charged to `meter` with its worst case: the prompt's bytes, and
    /// [`REMOTE_MAX_TOKENS`] of output, which the request carries.
    async fn ask(
        &self,
        system: &str,
        messages: Vec<Message>,
        constraint: Option<Constraint>,
        deltas: &mut PlanDeltas<'_>,
        meter: Meter<'_>,
    ) -> Result<Asked, PlannerError> {
        let output_cap = REMOTE_MAX_TOKENS;
        let worst = WorstCase::of(Some(system), &messages, output_cap, &self.pricing);
        let request = ChatRequest {
            system: Some(system.to_owned()),
            messages,
            max_tokens: Some(output_cap),
            constraint,
            ..ChatRequest::default()
        };
        // Both the attempts and the retry notes write to the plan's text.
        let deltas = std::sync::Mutex::new(deltas);
        let write = |text: &str| (deltas.lock().unwrap_or_else(std::sync::PoisonError::into_inner))(text);
        // Every attempt's usage counts toward the plan's, failed ones included.
        let spent = std::sync::Mutex::new(Figures::default());
        let attempt = || async {
            // A budget refusal is not a provider error: it ends the retries (inner `Err`).
            let reservation = match meter.reserve("the conductor", worst, &self.pricing).await {
                Ok(r) => r,
                Err(refused) => return Ok(Err(PlannerError::refused(refused))),
            };
            // A call cut short (an error here, or a time-out or stop that drops this future)
            // counts what the server reported and the text that came, as a worker's does.
            let received = std::sync::atomic::AtomicUsize::new(0);
            let too_long = tokio::sync::Notify::new();
            let on_text = &mut |t: &str| {
                reservation.received(t.len());
                let so_far = received.fetch_add(t.len(), std::sync::atomic::Ordering::Relaxed) + t.len();
                if so_far > REMOTE_MAX_PLAN_BYTES {
                    too_long.notify_one();
                } else {
                    write(t);
                }
            };
            // From here the request goes out: its input counts even if nothing comes back.
            reservation.sent(false);
            let reading = read_answer(self.model.as_ref(), request.clone(), on_text, reservation.reported());
            let cut = || {
                ProviderError::new(
                    ErrorKind::MalformedResponse,
                    format!(
                        "the answer ran past {REMOTE_MAX_PLAN_BYTES} bytes, far beyond a plan's length (the server does not honour max_tokens = {REMOTE_MAX_TOKENS}); it was cut off"
                    ),
                )
            };
            let answer = tokio::select! {
                answer = reading => answer,
                () = too_long.notified() => Err(cut()),
            };
            // The last piece may have come with the end of the answer.
            let answer = answer.and_then(|a| {
                if received.load(std::sync::atomic::Ordering::Relaxed) > REMOTE_MAX_PLAN_BYTES {
                    Err(cut())
                } else {
                    Ok(a)
                }
            });
            let (usage, cost_usd) = match &answer {
                Ok(a) => {
                    let cost = self.pricing.cost(&a.usage);
                    reservation.settle(a.usage, cost);
                    (a.usage, cost)
                }
                Err(e) => reservation.settle_failed(e),
            };
            spent.lock().unwrap_or_else(std::sync::PoisonError::into_inner).add(usage, cost_usd);
            answer.map(Ok)
        };
        let on_retry = |r: baton_engine::calls::Retrying<'_>| {
            write(&format!(
                "\n\n[the conductor's server failed: {}; trying again in {:.1} s]\n\n",
                r.error,
                r.delay.as_secs_f64()
            ));
        };
        let answer = with_retries(&self.options.call, meter.stop, attempt, on_retry).await;
        let spent = spent.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        let (usage, cost_usd) = (spent.usage, spent.cost());
        let answer = answer.map_err(|e| PlannerError::new(format!("the conductor's server: {e}")))??;
        Ok(Asked { text: answer.text, usage, cost_usd, stop_reason: answer.stop_reason })
    }
}

/// One answer from a remote conductor, and what it cost.
struct Asked {
    text: String,
    usage: Usage,
    cost_usd: Option<f64>,
    stop_reason: Option<String>,
}

impl Planner for RemoteConductor {
    fn describe(&self) -> String {
        match self.grammar {
            Some(g) => format!("{} (remote, {} grammar)", self.name, g.as_str()),
            None => format!("{} (remote)", self.name),
        }
    }

    fn plan<'a>(
        &'a self,
        ctx: PlanningContext,
        mut deltas: PlanDeltas<'a>,
        meter: Meter<'a>,
    ) -> BoxFuture<'a, Result<Planned, PlannerError>> {
        Box::pin(within_time_limit(self.options.plan_time_limit, async move {
            let system = self.prompts.system(&ctx);
            let mut messages = self.prompts.messages(&ctx);
            let constraint = self.constraint(&ctx);
            let first = self.ask(&system, messages.clone(), constraint.clone(), &mut deltas, meter).await?;
            let Asked { text, usage, cost_usd, stop_reason } = first;
            let record = self.prompts.record(&system, &messages);
            let examples = self.prompts.shown_examples(&ctx);
            let error = match baton_plan::parse(&text, &ctx.limits()) {
                Ok(plan) => {
                    return Ok(Planned {
                        raw: text,
                        plan,
                        usage,
                        cost_usd,
                        stop_reason,
                        prompt: Some(record),
                        examples,
                        routed: None,
                    });
                }
                Err(e) => e,
            };
            // One more try, with the error fed back.
            let retry_note = format!("\n\n[the plan could not be used: {error}; asking again]\n\n");
            deltas(&retry_note);
            messages.push(Message::assistant(text));
            messages.push(Message::user(format!(
                "That plan could not be used: {error}. Write your reasoning and the three lists again, exactly in the required format."
            )));
            let record = self.prompts.record(&system, &messages);
            let second = self.ask(&system, messages, constraint, &mut deltas, meter).await?;
            let mut total = usage;
            total += second.usage;
            let cost_usd = cost_usd.zip(second.cost_usd).map(|(a, b)| a + b);
            match baton_plan::parse(&second.text, &ctx.limits()) {
                Ok(plan) => Ok(Planned {
                    raw: second.text,
                    plan,
                    usage: total,
                    cost_usd,
                    stop_reason: second.stop_reason,
                    prompt: Some(record),
                    examples,
                    routed: None,
                }),
                Err(e) => Err(PlannerError::new(format!(
                    "the conductor's plan could not be used twice: first {error}; then {e}"
                ))),
            }
        }))
    }
}
