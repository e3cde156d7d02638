//! An in-process [`ChatModel`] with a fixed latency, for executor tests and the overhead
//! benchmark, where HTTP would blur what is being measured.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::future::BoxFuture;

use crate::{ChatEvent, ChatModel, ChatRequest, ChatStream, ProviderError, Role, Usage};

/// Answers every request after `latency`, with text derived from the request.
#[derive(Debug, Clone)]
pub struct FakeModel {
    pub name: String,
    pub latency: Duration,
    /// Sum of the time spent inside calls, in microseconds (for benchmarks).
    busy_micros: Arc<AtomicU64>,
}

impl FakeModel {
    pub fn new(name: impl Into<String>, latency: Duration) -> Self {
        FakeModel { name: name.into(), latency, busy_micros: Arc::default() }
    }

    /// Total time spent inside calls so far.
    pub fn busy(&self) -> Duration {
        Duration::from_micros(self.busy_micros.load(Ordering::Relaxed))
    }

    /// The text this model answers to `request`: its name, how many earlier answers it saw, and
    /// the start of its instruction.
    pub fn answer_for(name: &str, request: &ChatRequest) -> String {
        let seen = request.messages.iter().filter(|m| m.role == Role::Assistant).count();
        let last: String = request.messages.last().map(|m| m.content.chars().take(40).collect()).unwrap_or_default();
        format!("{name} saw {seen} answers: {last}")
    }
}

impl ChatModel for FakeModel {
    fn stream(&self, request: ChatRequest) -> BoxFuture<'static, Result<ChatStream, ProviderError>> {
        let me = self.clone();
        Box::pin(async move {
            let start = Instant::now();
            tokio::time::sleep(me.latency).await;
            me.busy_micros.fetch_add(start.elapsed().as_micros() as u64, Ordering::Relaxed);
            let text = FakeModel::answer_for(&me.name, &request);
            let input: u64 = request.messages.iter().map(|m| m.content.len() as u64 / 4 + 1).sum();
            let usage = Usage { input_tokens: input, output_tokens: text.len() as u64 / 4 + 1, ..Usage::default() };
            let items =
                vec![Ok(ChatEvent::Text(text)), Ok(ChatEvent::Done { usage, stop_reason: Some("stop".into()) })];
            Ok(futures::stream::iter(items).boxed())
        })
    }
}
