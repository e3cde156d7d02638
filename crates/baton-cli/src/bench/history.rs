//! `bench history`: the history database at scale, filled with generated runs and then queried.

use std::time::Instant;

use super::median_max;
use crate::{Failure, Outcome};

pub(super) async fn run(db: &std::path::Path, runs: u32, steps: u32, repeat: usize, json: bool) -> Outcome {
    let failed = |e: baton_store::StoreError| Failure::Failed(e.to_string());
    if repeat == 0 {
        return Err(Failure::BadInput("--repeat must be at least 1".into()));
    }
    let store = baton_store::Store::open(db).await.map_err(|e| Failure::BadInput(e.to_string()))?;
    let started = Instant::now();
    let last = baton_store::synthetic::populate(&store, runs, steps, 7).await.map_err(failed)?;
    let fill_s = started.elapsed().as_secs_f64();
    eprintln!("added {runs} runs of {steps} steps in {fill_s:.1} s");
    let total: Vec<baton_store::RunSummary> = store.list_runs(1, None).await.map_err(failed)?;
    let newest = total.first().map_or(last, |r| r.id);
    let time = async |label: &str, f: &mut dyn FnMut() -> futures::future::BoxFuture<'static, usize>| {
        let mut ms = Vec::with_capacity(repeat);
        let mut n = 0;
        for _ in 0..repeat {
            let t = Instant::now();
            n = f().await;
            ms.push(t.elapsed().as_secs_f64() * 1000.0);
        }
        let (median, max) = median_max(&mut ms);
        eprintln!("{label:<28} {median:>8.2} ms median  {max:>8.2} ms worst  ({n} results)");
        (label.to_owned(), median, max, n)
    };
    let s = store.clone();
    let list = time("list latest 50", &mut || {
        let s = s.clone();
        Box::pin(async move { s.list_runs(50, None).await.map_or(0, |r| r.len()) })
    })
    .await;
    let s = store.clone();
    let common = time("search a common word", &mut || {
        let s = s.clone();
        Box::pin(async move { s.search("energy", 50).await.map_or(0, |r| r.len()) })
    })
    .await;
    let s = store.clone();
    let rare = time("search a rare phrase", &mut || {
        let s = s.clone();
        Box::pin(async move { s.search(&format!("case {}", newest / 2), 50).await.map_or(0, |r| r.len()) })
    })
    .await;
    let s = store.clone();
    let open = time("open one run", &mut || {
        let s = s.clone();
        Box::pin(async move { s.run(newest / 2).await.ok().flatten().map_or(0, |t| t.steps.len()) })
    })
    .await;
    store.close().await;
    if json {
        let figures: Vec<serde_json::Value> = [list, common, rare, open]
            .into_iter()
            .map(|(label, median, max, n)| serde_json::json!({"query": label, "median_ms": median, "max_ms": max, "results": n}))
            .collect();
        println!(
            "{}",
            crate::json::line(&serde_json::json!({"runs_in_db": newest, "fill_s": fill_s, "queries": figures}))
        );
    }
    Ok(())
}
