//! One call to a model, tried the way Baton tries every call outside a run's steps: the remote
//! conductor's requests and a worker's connection check get the workers' policy (a time limit
//! per attempt, retries on rate limits, overload, timeouts and broken connections, with the
//! pool's backoff and the provider's `Retry-After`), and both stop the moment they are told to.

use std::future::Future;
use std::time::{Duration, Instant};

use baton_providers::{ChatEvent, ChatRequest, ErrorKind, Message, ProviderError, RetryPolicy};
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

use crate::executor::Worker;

/// How long one attempt may take, and how failed attempts are retried.
#[derive(Debug, Clone, PartialEq)]
pub struct CallPolicy {
    pub timeout: Duration,
    pub retry: RetryPolicy,
}

impl Default for CallPolicy {
    /// The workers' defaults (`timeout_secs = 300`, the default `[retry]` table).
    fn default() -> Self {
        CallPolicy { timeout: Duration::from_secs(300), retry: RetryPolicy::default() }
    }
}

/// A retry about to happen: which one (1 for the first), why, and after how long a wait.
#[derive(Debug)]
pub struct Retrying<'a> {
    pub retry: u32,
    pub error: &'a ProviderError,
    pub delay: Duration,
}

/// Runs `attempt` until it succeeds, fails in a way `policy` does not retry, or the retries run
/// out; each attempt is cut at `policy.timeout` (dropping it, which closes its connection).
/// `on_retry` hears of each retry before its wait. A stop ends the call at once with a
/// `cancelled` error.
pub async fn with_retries<T, Fut>(
    policy: &CallPolicy,
    stop: &CancellationToken,
    mut attempt: impl FnMut() -> Fut,
    mut on_retry: impl FnMut(Retrying<'_>),
) -> Result<T, ProviderError>
where
    Fut: Future<Output = Result<T, ProviderError>>,
{
    let stopped = || ProviderError::new(ErrorKind::Cancelled, "stopped");
    let mut retries = 0;
    loop {
        let result = tokio::select! {
            biased;
            () = stop.cancelled() => return Err(stopped()),
            result = tokio::time::timeout(policy.timeout, attempt()) => result.unwrap_or_else(|_| {
                Err(ProviderError::new(
                    ErrorKind::Timeout,
                    format!("no complete answer within {} s (timeout_secs)", policy.timeout.as_secs_f64()),
                ))
            }),
        };
        let error = match result {
            Ok(value) => return Ok(value),
            Err(error) => error,
        };
        retries += 1;
        let Some(delay) = policy.retry.delay(retries, &error) else { return Err(error) };
        on_retry(Retrying { retry: retries, error: &error, delay });
        tokio::select! {
            biased;
            () = stop.cancelled() => return Err(stopped()),
            () = tokio::time::sleep(delay) => {}
        }
    }
}

/// What a worker said to a connection check.
#[derive(Debug, Clone, PartialEq)]
pub struct Checked {
    /// The first words of the answer.
    pub reply: String,
    /// From the first request to the answer's end, retries included.
    pub latency: Duration,
    /// Retries it took.
    pub retries: u32,
}

/// Sends `worker` a tiny request with its real settings and key, under the workers' policy
/// (its own `timeout_secs`, the pool's `[retry]`). The command line's `baton pool check` and
/// the app's "Test connection" both check through here.
pub async fn check_worker(
    worker: &Worker,
    retry: &RetryPolicy,
    stop: &CancellationToken,
) -> Result<Checked, ProviderError> {
    let policy = CallPolicy { timeout: worker.timeout, retry: retry.clone() };
    let started = Instant::now();
    let mut retries = 0;
    let reply = with_retries(
        &policy,
        stop,
        || async {
            let request = ChatRequest {
                messages: vec![Message::user("Reply with the single word OK.")],
                max_tokens: Some(16),
                ..ChatRequest::default()
            };
            let mut stream = worker.model.stream(request).await?;
            let mut text = String::new();
            while let Some(item) = stream.next().await {
                match item? {
                    ChatEvent::Text(t) => text.push_str(&t),
                    ChatEvent::Usage(_) => {}
                    ChatEvent::Done { .. } => return Ok(text),
                }
            }
            Err(ProviderError::new(ErrorKind::Network, "the stream ended without completing"))
        },
        |r| retries = r.retry,
    )
    .await?;
    Ok(Checked { reply: reply.chars().take(80).collect(), latency: started.elapsed(), retries })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quick(max_retries: u32) -> CallPolicy {
        CallPolicy {
            timeout: Duration::from_millis(200),
            retry: RetryPolicy {
                max_retries,
                initial_delay: Duration::from_millis(1),
                max_delay: Duration::from_millis(2),
                ..RetryPolicy::default()
            },
        }
    }

    #[tokio::test]
    async fn retryable_errors_are_retried_and_others_are_not() {
        let stop = CancellationToken::new();
        let mut calls = 0;
        let mut heard = Vec::new();
        let got = with_retries(
            &quick(3),
            &stop,
            || {
                calls += 1;
                let n = calls;
                async move { if n < 3 { Err(ProviderError::new(ErrorKind::RateLimited, "slow down")) } else { Ok(n) } }
            },
            |r| heard.push(r.retry),
        )
        .await;
        assert_eq!(got, Ok(3));
        assert_eq!(heard, [1, 2]);

        let mut calls = 0;
        let got: Result<(), _> = with_retries(
            &quick(3),
            &stop,
            || {
                calls += 1;
                async { Err(ProviderError::new(ErrorKind::Auth, "bad key")) }
            },
            |_| {},
        )
        .await;
        assert_eq!(got.unwrap_err().kind, ErrorKind::Auth);
        assert_eq!(calls, 1, "an auth error is never retried");
    }

    #[tokio::test]
    async fn each_attempt_is_cut_at_the_timeout_and_a_stop_ends_the_call() {
        let stop = CancellationToken::new();
        let mut calls = 0;
        let got: Result<(), _> = with_retries(
            &quick(1),
            &stop,
            || {
                calls += 1;
                std::future::pending()
            },
            |_| {},
        )
        .await;
        assert_eq!(got.unwrap_err().kind, ErrorKind::Timeout);
        assert_eq!(calls, 2, "the first attempt and one retry");

        let policy = CallPolicy { timeout: Duration::from_secs(3600), ..quick(0) };
        let stopper = stop.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            stopper.cancel();
        });
        let got: Result<(), _> = with_retries(&policy, &stop, std::future::pending, |_| {}).await;
        assert_eq!(got.unwrap_err().kind, ErrorKind::Cancelled);
    }
}
