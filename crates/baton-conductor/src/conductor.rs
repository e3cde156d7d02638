//! Conductors: a local model that writes plans under a grammar, or a remote OpenAI-compatible
//! endpoint whose answers are parsed (and retried once, with the error fed back).

use std::sync::Arc;

use baton_engine::{PlanDeltas, Planned, Planner, PlannerError, PlanningContext, WorkerInfo};
use baton_plan::Limits;
use baton_providers::{ChatEvent, ChatModel, ChatRequest, Constraint, Message, ServerGrammar, Usage};
use futures::StreamExt;
use futures::future::BoxFuture;

use crate::grammar::PlanGrammar;
use crate::prompt::PromptBuilder;

/// How a conductor writes.
#[derive(Debug, Clone, PartialEq)]
pub struct ConductorOptions {
    /// Longest reasoning before the lists, in characters.
    pub max_reasoning_chars: usize,
    /// Longest subtask, in characters.
    pub max_subtask_chars: usize,
    /// `None` uses the model's generation defaults.
    pub temperature: Option<f64>,
    /// Whenever the conductor may pick itself, it must (tests drive recursion to its caps).
    pub force_self: bool,
    /// Leave the few-shot workflows out of the prompt.
    pub no_examples: bool,
}

impl Default for ConductorOptions {
    fn default() -> Self {
        ConductorOptions {
            max_reasoning_chars: 1200,
            max_subtask_chars: 600,
            temperature: Some(0.3),
            force_self: false,
            no_examples: false,
        }
    }
}

impl ConductorOptions {
    fn prompts(&self, workers: Vec<WorkerInfo>) -> PromptBuilder {
        let p = PromptBuilder::new(workers);
        if self.no_examples { p.without_examples() } else { p }
    }
}

fn limits(ctx: &PlanningContext) -> Limits {
    Limits {
        max_steps: ctx.max_steps,
        pool_size: Some(ctx.pool_size + usize::from(ctx.allow_self)),
        allow_stop: ctx.allow_stop,
    }
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

/// A conductor running in process on a local model, constrained to valid plans.
#[cfg(feature = "local")]
pub struct LocalConductor {
    model: Arc<crate::local::LocalModel>,
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
    pub fn new(model: Arc<crate::local::LocalModel>, workers: Vec<WorkerInfo>, options: ConductorOptions) -> Self {
        LocalConductor { model, prompts: options.prompts(workers), options }
    }

    /// Writes one plan and reports how fast (for `baton bench conductor`).
    pub async fn plan_with_stats(
        &self,
        ctx: &PlanningContext,
        on_text: &mut (dyn FnMut(&str) + Send),
    ) -> Result<(Planned, crate::local::Generated), PlannerError> {
        let grammar = grammar_for(ctx, &self.options);
        // The grammar bounds characters; a token is at least one byte and a character at most
        // four, so this cap is never what ends a plan (ending early would leave it unparsable).
        let max_chars = self.options.max_reasoning_chars + ctx.max_steps * (self.options.max_subtask_chars + 60) + 200;
        let max_tokens = 4 * max_chars;
        let options = crate::local::GenerateOptions {
            grammar: Some(grammar.to_lark()),
            max_tokens,
            temperature: self.options.temperature,
        };
        let system = self.prompts.system(ctx);
        let messages = self.prompts.messages(ctx);
        let generated = self
            .model
            .generate(Some(&system), &messages, &options, on_text)
            .await
            .map_err(|e| PlannerError::new(e.message))?;
        let plan = baton_plan::parse(&generated.text, &limits(ctx)).map_err(|e| {
            PlannerError::new(format!(
                "the constrained plan did not parse ({e}); stop reason {:?}",
                generated.finish_reason
            ))
        })?;
        Ok((Planned { raw: generated.text.clone(), plan, usage: generated.usage }, generated))
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
    ) -> BoxFuture<'a, Result<Planned, PlannerError>> {
        Box::pin(async move {
            let mut on_text = |t: &str| deltas(t);
            self.plan_with_stats(&ctx, &mut on_text).await.map(|(planned, _)| planned)
        })
    }
}

/// A conductor behind an OpenAI-compatible endpoint (vLLM, SGLang, Ollama, llama.cpp).
pub struct RemoteConductor {
    model: Arc<dyn ChatModel>,
    name: String,
    prompts: PromptBuilder,
    options: ConductorOptions,
    /// The server's structured-output extension, when it has one the user named.
    grammar: Option<ServerGrammar>,
}

impl std::fmt::Debug for RemoteConductor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteConductor").field("name", &self.name).finish_non_exhaustive()
    }
}

impl RemoteConductor {
    /// `name` describes the endpoint for people, e.g. `"qwen2.5-72b at http://gpu:8000/v1"`.
    pub fn new(model: Arc<dyn ChatModel>, name: String, workers: Vec<WorkerInfo>, options: &ConductorOptions) -> Self {
        RemoteConductor { model, name, prompts: options.prompts(workers), options: options.clone(), grammar: None }
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

    async fn ask(
        &self,
        system: &str,
        messages: Vec<Message>,
        constraint: Option<Constraint>,
        deltas: &mut PlanDeltas<'_>,
    ) -> Result<(String, Usage), PlannerError> {
        let request = ChatRequest { system: Some(system.to_owned()), messages, max_tokens: None, constraint };
        let mut stream = self.model.stream(request).await.map_err(|e| PlannerError::new(e.to_string()))?;
        let mut text = String::new();
        while let Some(item) = stream.next().await {
            match item.map_err(|e| PlannerError::new(e.to_string()))? {
                ChatEvent::Text(t) => {
                    deltas(&t);
                    text.push_str(&t);
                }
                ChatEvent::Done { usage, .. } => return Ok((text, usage)),
            }
        }
        Err(PlannerError::new("the conductor's answer ended early"))
    }
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
    ) -> BoxFuture<'a, Result<Planned, PlannerError>> {
        Box::pin(async move {
            let system = self.prompts.system(&ctx);
            let mut messages = self.prompts.messages(&ctx);
            let constraint = self.constraint(&ctx);
            let (text, usage) = self.ask(&system, messages.clone(), constraint.clone(), &mut deltas).await?;
            let error = match baton_plan::parse(&text, &limits(&ctx)) {
                Ok(plan) => return Ok(Planned { raw: text, plan, usage }),
                Err(e) => e,
            };
            // One more try, with the error fed back.
            let retry_note = format!("\n\n[the plan could not be used: {error}; asking again]\n\n");
            deltas(&retry_note);
            messages.push(Message::assistant(text));
            messages.push(Message::user(format!(
                "That plan could not be used: {error}. Write your reasoning and the three lists again, exactly in the required format."
            )));
            let (second, usage2) = self.ask(&system, messages, constraint, &mut deltas).await?;
            let mut total = usage;
            total += usage2;
            match baton_plan::parse(&second, &limits(&ctx)) {
                Ok(plan) => Ok(Planned { raw: second, plan, usage: total }),
                Err(e) => Err(PlannerError::new(format!(
                    "the conductor's plan could not be used twice: first {error}; then {e}"
                ))),
            }
        })
    }
}
