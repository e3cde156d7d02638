//! Running many runs at once within the spending cap: each run is promised a share of what is
//! left before it starts, so the caps of the runs in flight never add up past the evaluation's.

use std::collections::HashSet;
use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use super::run_one::{Job, RunCtx, run_one};
use super::{Ended, EvalError, Progress};
use crate::suite::Item;

/// The jobs whose result is not recorded yet (a resume pays for nothing twice).
pub(super) fn not_done(jobs: Vec<Job>, done: &HashSet<(String, String, u32)>, items: &[Item]) -> Vec<Job> {
    jobs.into_iter().filter(|j| !done.contains(&(j.strategy.clone(), items[j.item].id.clone(), j.repeat))).collect()
}

/// Runs `jobs`, `concurrency` at a time. `Some(end)` when stopped early.
pub(super) async fn run_jobs(
    ctx: &Arc<RunCtx<'_>>,
    jobs: Vec<Job>,
    concurrency: usize,
    cancel: &CancellationToken,
) -> Result<Option<Ended>, EvalError> {
    use futures::StreamExt;
    let concurrency = concurrency.max(1);
    let mut pending = jobs.into_iter();
    let mut running = futures::stream::FuturesUnordered::new();
    let mut failure: Option<EvalError> = None;
    loop {
        while running.len() < concurrency && failure.is_none() && !cancel.is_cancelled() {
            let share = {
                let mut purse = ctx.purse.lock().unwrap_or_else(|e| e.into_inner());
                if purse.over {
                    None
                } else {
                    match purse.cap {
                        None => Some(None),
                        Some(cap) => {
                            let left = cap - purse.spent - purse.promised;
                            if left <= 0.0 {
                                purse.over = true;
                                None
                            } else {
                                // What is left, shared by the free slots: the caps of runs in
                                // flight never add up past the evaluation's.
                                let share = left / (concurrency - running.len()) as f64;
                                purse.promised += share;
                                Some(Some(share))
                            }
                        }
                    }
                }
            };
            let Some(share) = share else { break };
            let Some(job) = pending.next() else {
                if let Some(s) = share {
                    ctx.purse.lock().unwrap_or_else(|e| e.into_inner()).promised -= s;
                }
                break;
            };
            let ctx = ctx.clone();
            let cancel = cancel.clone();
            running.push(async move {
                let out = run_one(&ctx, &job, share, &cancel).await;
                (share, out)
            });
        }
        let Some((share, out)) = running.next().await else { break };
        let mut purse = ctx.purse.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = share {
            purse.promised -= s;
        }
        match out {
            Ok(Some(budget_hit)) if budget_hit => purse.over = true,
            Ok(_) => {}
            Err(e) => failure = failure.or(Some(e)),
        }
    }
    if let Some(e) = failure {
        return Err(e);
    }
    if cancel.is_cancelled() {
        return Ok(Some(Ended::Stopped));
    }
    let over = ctx.purse.lock().unwrap_or_else(|e| e.into_inner()).over;
    if over {
        (ctx.progress)(Progress::Note(
            "the spending cap is reached: run again with a higher --max-cost-usd to go on".into(),
        ));
        return Ok(Some(Ended::OverBudget));
    }
    Ok(None)
}
