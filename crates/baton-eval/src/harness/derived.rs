//! What is computed from other results rather than run: the lookup router's table and MoA's
//! aggregator (from the calibration split), best-of-n's `n` (from the conductor's cost), and the
//! routers' and the oracle's rows (from the single workers' test results).

use std::collections::{BTreeMap, HashMap, HashSet};

use baton_engine::accounting::Figures;
use baton_store::evaluations::EvalResult;

use crate::strategy::Strategy;
use crate::suite::Item;

/// Per category, the worker with the best calibration accuracy (ties: the better overall, then
/// pool order); and the best worker overall (MoA's aggregator).
pub(super) fn lookup_table(
    results: &[EvalResult],
    workers: &[String],
    items: &[Item],
) -> (BTreeMap<String, String>, Option<String>) {
    let ids: HashSet<&str> = items.iter().map(|i| i.id.as_str()).collect();
    let mut per: HashMap<(&str, usize), (u32, u32)> = HashMap::new();
    let mut overall: Vec<(u32, u32)> = vec![(0, 0); workers.len()];
    for r in results.iter().filter(|r| r.split == "calibration" && ids.contains(r.item_id.as_str())) {
        let Some(w) = workers.iter().position(|w| r.strategy == format!("single:{w}")) else { continue };
        let e = per.entry((r.category.as_str(), w)).or_default();
        e.0 += u32::from(r.correct);
        e.1 += 1;
        overall[w].0 += u32::from(r.correct);
        overall[w].1 += 1;
    }
    let rate = |(c, n): (u32, u32)| if n == 0 { -1.0 } else { f64::from(c) / f64::from(n) };
    let categories: HashSet<&str> = per.keys().map(|(c, _)| *c).collect();
    let mut table = BTreeMap::new();
    for c in categories {
        let best = (0..workers.len()).max_by(|&a, &b| {
            let ka = (rate(per.get(&(c, a)).copied().unwrap_or_default()), rate(overall[a]));
            let kb = (rate(per.get(&(c, b)).copied().unwrap_or_default()), rate(overall[b]));
            ka.partial_cmp(&kb).unwrap_or(std::cmp::Ordering::Equal).then(b.cmp(&a))
        });
        if let Some(w) = best {
            table.insert(c.to_owned(), workers[w].clone());
        }
    }
    let best = (0..workers.len())
        .filter(|&w| overall[w].1 > 0)
        .max_by(|&a, &b| {
            rate(overall[a]).partial_cmp(&rate(overall[b])).unwrap_or(std::cmp::Ordering::Equal).then(b.cmp(&a))
        })
        .map(|w| workers[w].clone());
    (table, best)
}

/// `n` for best-of-n: the conductor's mean cost per test item over the worker's (dollars, or
/// tokens where either is unpriced), rounded; 3 without conductor results.
pub(super) fn matched_n(results: &[EvalResult], single: &str) -> u32 {
    let of =
        |s: &str| -> Vec<&EvalResult> { results.iter().filter(|r| r.strategy == s && r.split == "test").collect() };
    let (conductor, worker) = (of("conductor"), of(single));
    if conductor.is_empty() || worker.is_empty() {
        return 3;
    }
    let dollars = |rs: &[&EvalResult]| rs.iter().map(|r| r.figures.cost_usd).sum::<f64>() / rs.len() as f64;
    let tokens = |rs: &[&EvalResult]| rs.iter().map(|r| r.figures.usage.total() as f64).sum::<f64>() / rs.len() as f64;
    let priced = conductor.iter().chain(&worker).all(|r| r.figures.cost_complete) && dollars(&worker) > 0.0;
    let ratio =
        if priced { dollars(&conductor) / dollars(&worker) } else { tokens(&conductor) / tokens(&worker).max(1.0) };
    ratio.round().max(1.0) as u32
}

/// The derived strategy's rows, from the single workers' test results of each repeat.
#[allow(clippy::too_many_arguments)]
pub(super) fn derive(
    strategy: &Strategy,
    results: &[EvalResult],
    workers: &[String],
    items: &[Item],
    test: &[usize],
    repeats: u32,
    lookup: &BTreeMap<String, String>,
    fallback: usize,
    seed: u64,
) -> Vec<EvalResult> {
    let single: HashMap<(&str, &str, u32), &EvalResult> = results
        .iter()
        .filter(|r| r.strategy.starts_with("single:"))
        .map(|r| ((r.strategy.as_str(), r.item_id.as_str(), r.repeat), r))
        .collect();
    let keys: Vec<String> = workers.iter().map(|w| format!("single:{w}")).collect();
    let mut rng = fastrand::Rng::with_seed(seed ^ 0x7a4d_0e11);
    let mut out = Vec::new();
    for &i in test {
        let item = &items[i];
        for r in 0..repeats {
            let of = |w: usize| single.get(&(keys[w].as_str(), item.id.as_str(), r)).copied();
            let chosen = match strategy {
                Strategy::RouterLookup => {
                    let w = lookup
                        .get(item.stratum())
                        .and_then(|name| workers.iter().position(|x| x == name))
                        .unwrap_or(fallback);
                    of(w)
                }
                Strategy::RouterRandom => of(rng.usize(..workers.len().max(1))),
                Strategy::Oracle => {
                    // Right if any worker is; it had to ask them all, so it pays for all.
                    let all: Vec<&EvalResult> = (0..workers.len()).filter_map(of).collect();
                    let Some(first) = all.iter().find(|x| x.correct).or(all.first()).copied() else { continue };
                    let mut row = first.clone();
                    row.figures = all.iter().fold(Figures::default(), |sum, x| sum.plus(&x.figures));
                    row.latency_ms = all.iter().map(|x| x.latency_ms).max().unwrap_or(0);
                    row.strategy = strategy.key();
                    out.push(row);
                    continue;
                }
                _ => None,
            };
            if let Some(c) = chosen {
                let mut row = c.clone();
                row.strategy = strategy.key();
                out.push(row);
            }
        }
    }
    out
}
