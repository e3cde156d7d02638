//! A pool worker that runs on a local model (`provider = "local"`), as the executor calls any
//! worker: a [`ChatModel`].

use std::sync::Arc;

use baton_providers::{ChatEvent, ChatModel, ChatRequest, ChatStream, ProviderError};
use futures::StreamExt;
use futures::future::BoxFuture;

use crate::engine::{GenerateOptions, LocalModel};

/// A pool worker that runs on a local model (`provider = "local"`).
#[derive(Debug, Clone)]
pub struct LocalWorker {
    pub model: Arc<LocalModel>,
    pub max_tokens: usize,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
}

impl ChatModel for LocalWorker {
    fn input_tokens(&self, request: &ChatRequest) -> BoxFuture<'static, Option<u64>> {
        let (model, system, messages) = (self.model.clone(), request.system.clone(), request.messages.clone());
        Box::pin(async move { model.prompt_tokens(system.as_deref(), &messages).await })
    }

    fn stream(&self, request: ChatRequest) -> BoxFuture<'static, Result<ChatStream, ProviderError>> {
        let me = self.clone();
        Box::pin(async move {
            let (tx, rx) = futures::channel::mpsc::unbounded();
            // Generation runs while the stream is read; dropping the stream drops the task's
            // receiver side, and dropping this task's future stops generation.
            let task = async move {
                let mut send = |t: &str| {
                    let _ = tx.unbounded_send(Ok(ChatEvent::Text(t.to_owned())));
                };
                let options = GenerateOptions {
                    grammar: None,
                    max_tokens: request.max_tokens.map_or(me.max_tokens, |m| m as usize),
                    temperature: request.temperature.map(f64::from).or(me.temperature),
                    top_p: request.top_p.map(f64::from).or(me.top_p),
                    complete_at: None,
                };
                let result = me.model.generate(request.system.as_deref(), &request.messages, &options, &mut send).await;
                match result {
                    Ok(g) => {
                        let _ = tx.unbounded_send(Ok(ChatEvent::Done { usage: g.usage, stop_reason: g.finish_reason }));
                    }
                    Err(e) => {
                        let _ = tx.unbounded_send(Err(e));
                    }
                }
            };
            let stream = futures::stream::select(rx, futures::stream::once(task).filter_map(|()| async { None }));
            Ok(stream.boxed())
        })
    }
}
