//! One generation: a request to the engine, its text streamed as it comes, and what it used
//! counted even when the engine reports nothing (a stream Baton cut, a silent end token).

use std::time::{Duration, Instant};

use baton_providers::{ErrorKind, Message, ProviderError, Usage};
use mistralrs::{Constraint, RequestBuilder, Response, SamplingParams, StopTokens};

use super::{LORA_ALIAS, LocalModel, Speed, chat_turns};

/// What one generation produced.
#[derive(Debug, Clone, PartialEq)]
pub struct Generated {
    pub text: String,
    pub usage: Usage,
    /// `stop` (an end token) or `length` (the token cap), as mistral.rs reports it; `complete`
    /// when Baton ended the stream itself after the text was complete (`cut_after_complete`).
    pub finish_reason: Option<String>,
    /// True when Baton ended the stream itself: the text was complete but the model had not
    /// stopped soon after (see [`GenerateOptions::complete_at`]).
    pub cut_after_complete: bool,
    /// From the request to the first piece of text.
    pub time_to_first_token: Option<Duration>,
    pub prompt_tokens_per_sec: f32,
    pub decode_tokens_per_sec: f32,
}

/// Generation settings for one request.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct GenerateOptions {
    /// A Lark grammar the output must follow.
    pub grammar: Option<String>,
    pub max_tokens: usize,
    /// `None` uses the model's generation defaults; `Some(0.0)` is greedy.
    pub temperature: Option<f64>,
    /// Nucleus sampling's share of the probability mass; `None`: the model's default.
    pub top_p: Option<f64>,
    /// Text that can only end a complete answer (a plan's closing fence): once the text ends
    /// with it, after an earlier fence (the opening one, which passes through the same text as
    /// it is written), the model gets a short grace to stop by itself, then the stream is
    /// dropped. A guard behind the stop tokens, for a model whose end token Baton did not find.
    pub complete_at: Option<String>,
}

impl LocalModel {
    /// Streams one generation; `on_text` sees each piece. Dropping the future stops it.
    pub async fn generate(
        &self,
        system: Option<&str>,
        messages: &[Message],
        options: &GenerateOptions,
        on_text: &mut (dyn FnMut(&str) + Send),
    ) -> Result<Generated, ProviderError> {
        // A new request starts greedy (mistral.rs's `deterministic()`: top-k 1), and a model's
        // generation defaults fill only what a request leaves unset: a temperature alone would
        // still keep only the likeliest token. Neutral settings make the temperature sample.
        let mut request = RequestBuilder::new().set_sampling(SamplingParams::neutral());
        for (role, content) in chat_turns(system, messages) {
            request = request.add_message(role, content);
        }
        if let Some(grammar) = &options.grammar {
            request = request.set_constraint(Constraint::Lark(grammar.clone()));
        }
        // Without a temperature the model's own generation defaults apply; 0 is greedy.
        if let Some(t) = options.temperature {
            request = request.set_sampler_temperature(t);
        }
        if let Some(p) = options.top_p {
            request = request.set_sampler_topp(p);
        }
        if self.lora {
            request = request.set_adapter(LORA_ALIAS);
        }
        request = request.set_sampler_max_len(options.max_tokens);
        request = request.set_sampler_stop_toks(StopTokens::Ids(self.end_tokens.all()));
        // The prompt's tokens (as the call's reservation counted them: remembered, not tokenized
        // again), to count them and what the prefix cache holds. mistral.rs tokenizes on its own.
        let prompt_tokens = self.prompt(system, messages).await.map(|t| t.to_vec()).unwrap_or_default();
        let cached_tokens = self.cached.cached_prefix(&prompt_tokens);

        let started = Instant::now();
        let mut stream =
            self.model.stream_chat_request(request).await.map_err(|e| generation_error(&format!("{e:#}")))?;
        let mut out = Generated {
            text: String::new(),
            usage: Usage::default(),
            finish_reason: None,
            cut_after_complete: false,
            time_to_first_token: None,
            prompt_tokens_per_sec: 0.0,
            decode_tokens_per_sec: 0.0,
        };
        let mut pieces = 0u32;
        // Set when the text first ends with `complete_at`: the moment Baton stops waiting for the
        // end token. Fixed then, so that tokens which decode to nothing (mistral.rs still sends a
        // chunk for each) cannot keep a finished answer alive; reset only by more text.
        let mut deadline: Option<tokio::time::Instant> = None;
        loop {
            // The opening fence (`\n```python\n`) passes through `\n```` on its way; only a
            // fence after an earlier one closes the plan (reasoning holds no backticks).
            let complete = options
                .complete_at
                .as_deref()
                .is_some_and(|end| out.text.strip_suffix(end).is_some_and(|before| before.contains(end.trim_start())));
            if !complete {
                deadline = None;
            } else if deadline.is_none() {
                // The answer is whole: its end token is the very next one. Wait a few tokens'
                // time for it (the finish reason and usage come with it), no longer.
                let per_piece = out
                    .time_to_first_token
                    .map_or(Duration::ZERO, |first| started.elapsed().saturating_sub(first) / pieces.max(1));
                let grace = (per_piece * 4).clamp(Duration::from_millis(500), Duration::from_secs(10));
                deadline = Some(tokio::time::Instant::now() + grace);
            }
            let next = match deadline {
                Some(deadline) => match tokio::time::timeout_at(deadline, stream.next()).await {
                    Ok(next) => next,
                    Err(_) => {
                        out.cut_after_complete = true;
                        break;
                    }
                },
                None => stream.next().await,
            };
            let Some(response) = next else { break };
            match response {
                Response::Chunk(chunk) => {
                    for choice in chunk.choices {
                        if let Some(text) = choice.delta.content
                            && !text.is_empty()
                        {
                            out.time_to_first_token.get_or_insert_with(|| started.elapsed());
                            pieces += 1;
                            on_text(&text);
                            out.text.push_str(&text);
                        }
                        if choice.finish_reason.is_some() {
                            out.finish_reason = choice.finish_reason;
                        }
                    }
                    if let Some(u) = chunk.usage {
                        out.usage = Usage {
                            input_tokens: u.prompt_tokens as u64,
                            output_tokens: u.completion_tokens as u64,
                            ..Usage::default()
                        };
                        out.prompt_tokens_per_sec = u.avg_prompt_tok_per_sec;
                        out.decode_tokens_per_sec = u.avg_compl_tok_per_sec;
                    }
                    if out.finish_reason.is_some() {
                        break;
                    }
                }
                Response::Done(done) => {
                    out.usage = Usage {
                        input_tokens: done.usage.prompt_tokens as u64,
                        output_tokens: done.usage.completion_tokens as u64,
                        ..Usage::default()
                    };
                    break;
                }
                Response::ModelError(message, _) => return Err(generation_error(&message)),
                Response::InternalError(e) | Response::ValidationError(e) => {
                    return Err(generation_error(&e.to_string()));
                }
                _ => {}
            }
        }
        drop(stream);
        let answer_tokens = self.text_tokens(&out.text).await;
        if out.usage == Usage::default() {
            // mistral.rs sends no last chunk (so no finish reason and no usage) when Baton cut a
            // complete answer short by dropping the stream. Count the tokens here instead, so
            // token caps and the history see real numbers: the prompt as the chat template
            // renders it, and the answer plus its end token (none when Baton cut it).
            let end = u64::from(!out.cut_after_complete);
            out.usage = Usage {
                input_tokens: prompt_tokens.len() as u64,
                output_tokens: answer_tokens.len() as u64 + end,
                ..Usage::default()
            };
            let reason = if out.cut_after_complete {
                "complete"
            } else if out.usage.output_tokens >= options.max_tokens as u64 {
                "length"
            } else {
                "stop"
            };
            out.finish_reason = Some(reason.to_owned());
        }
        out.usage.cached_input_tokens = cached_tokens.min(out.usage.input_tokens as usize) as u64;
        self.note_speed(&mut out, started.elapsed());
        if !out.cut_after_complete {
            // mistral.rs caches a finished sequence's KV (not a dropped one), whether or not it
            // sent a last chunk.
            let mut sequence = prompt_tokens;
            sequence.extend(answer_tokens);
            self.cached.remember(sequence);
        }
        Ok(out)
    }

    /// Fills in the rates mistral.rs did not report (it sends no usage chunk when a sequence
    /// ends on a silent end token or is cut) from the timings, and keeps them as the latest.
    fn note_speed(&self, out: &mut Generated, total: Duration) {
        let fresh = out.usage.input_tokens.saturating_sub(out.usage.cached_input_tokens);
        if let Some(first) = out.time_to_first_token {
            if out.prompt_tokens_per_sec <= 0.0 && !first.is_zero() {
                out.prompt_tokens_per_sec = fresh as f32 / first.as_secs_f32();
            }
            let decoding = total.saturating_sub(first);
            if out.decode_tokens_per_sec <= 0.0 && !decoding.is_zero() {
                out.decode_tokens_per_sec = out.usage.output_tokens.saturating_sub(1) as f32 / decoding.as_secs_f32();
            }
        }
        *self.last.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Speed {
            prompt_tokens_per_sec: f64::from(out.prompt_tokens_per_sec),
            decode_tokens_per_sec: f64::from(out.decode_tokens_per_sec),
            prompt_tokens: out.usage.input_tokens,
            cached_prompt_tokens: out.usage.cached_input_tokens,
            output_tokens: out.usage.output_tokens,
        });
    }
}

/// A failed generation as a provider error: a missing chat template is the request's fault (not
/// retried), anything else the engine's (retried as an overloaded server would be).
fn generation_error(message: &str) -> ProviderError {
    if message.to_ascii_lowercase().contains("chat template") {
        return ProviderError::new(
            ErrorKind::BadRequest,
            format!("{message}; give the model a chat template (chat_template = \"FILE.jinja\")"),
        );
    }
    ProviderError::new(ErrorKind::Overloaded, format!("local generation failed: {message}"))
}
