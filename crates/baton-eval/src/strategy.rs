//! What an evaluation compares: ways of answering a question with the same pool.

use std::fmt;

/// One way of answering. Run side by side on the same items.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Strategy {
    /// The user's conductor and pool, as the app runs them.
    Conductor,
    /// One worker alone.
    Single(String),
    /// Mixture-of-Agents: every worker proposes (up to the pool's step limit less one), then
    /// the strongest worker (best on the calibration split, else the pool's first) aggregates.
    Moa,
    /// The lookup-table router: per category, the worker best on the calibration split.
    RouterLookup,
    /// A worker drawn at random per item (seeded).
    RouterRandom,
    /// Self-consistency: `n` samples of one worker, the most common answer wins. Without `n`,
    /// `n` is chosen to match the conductor's measured cost per item.
    BestOfN { worker: String, n: Option<u32> },
    /// Right when any worker alone is right: the ceiling of routing.
    Oracle,
}

impl Strategy {
    /// Reads `conductor`, `single:W`, `moa`, `router:lookup`, `router:random`,
    /// `best-of-n:W[:N]`, `oracle`, checking worker names against the pool.
    pub fn parse(s: &str, workers: &[String]) -> Result<Strategy, String> {
        let worker = |w: &str| {
            if workers.iter().any(|x| x == w) {
                Ok(w.to_owned())
            } else {
                Err(format!("{s}: the pool has no worker {w:?} (workers: {})", workers.join(", ")))
            }
        };
        Ok(match s {
            "conductor" => Strategy::Conductor,
            "moa" => Strategy::Moa,
            "router:lookup" => Strategy::RouterLookup,
            "router:random" => Strategy::RouterRandom,
            "oracle" => Strategy::Oracle,
            _ => {
                if let Some(w) = s.strip_prefix("single:") {
                    Strategy::Single(worker(w)?)
                } else if let Some(rest) = s.strip_prefix("best-of-n:") {
                    // A worker name may itself contain ':'; a trailing `:N` is the sample count.
                    match rest.rsplit_once(':') {
                        Some((w, n)) if n.parse::<u32>().is_ok() && workers.iter().any(|x| x == w) => {
                            let n: u32 = n.parse().unwrap_or(1);
                            if n == 0 {
                                return Err(format!("{s}: n must be at least 1"));
                            }
                            Strategy::BestOfN { worker: w.to_owned(), n: Some(n) }
                        }
                        _ => Strategy::BestOfN { worker: worker(rest)?, n: None },
                    }
                } else {
                    return Err(format!(
                        "unknown strategy {s:?}: use conductor, single:WORKER, moa, router:lookup, router:random, best-of-n:WORKER[:N] or oracle"
                    ));
                }
            }
        })
    }

    /// Reads a comma-separated list; `all-singles` stands for `single:W` for every worker.
    pub fn parse_list(s: &str, workers: &[String]) -> Result<Vec<Strategy>, String> {
        let mut out: Vec<Strategy> = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let add: Vec<Strategy> = if part == "all-singles" {
                workers.iter().map(|w| Strategy::Single(w.clone())).collect()
            } else {
                vec![Strategy::parse(part, workers)?]
            };
            for st in add {
                if !out.contains(&st) {
                    out.push(st);
                }
            }
        }
        if out.is_empty() {
            return Err("no strategies given".into());
        }
        Ok(out)
    }

    /// Built from the single workers' results on the same items, not run on their own.
    pub fn is_derived(&self) -> bool {
        matches!(self, Strategy::RouterLookup | Strategy::RouterRandom | Strategy::Oracle)
    }

    /// Its name in results and reports (best-of-n without its `n`, which is in the config).
    pub fn key(&self) -> String {
        match self {
            Strategy::BestOfN { worker, .. } => format!("best-of-n:{worker}"),
            other => other.to_string(),
        }
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Strategy::Conductor => f.write_str("conductor"),
            Strategy::Single(w) => write!(f, "single:{w}"),
            Strategy::Moa => f.write_str("moa"),
            Strategy::RouterLookup => f.write_str("router:lookup"),
            Strategy::RouterRandom => f.write_str("router:random"),
            Strategy::BestOfN { worker, n: Some(n) } => write!(f, "best-of-n:{worker}:{n}"),
            Strategy::BestOfN { worker, n: None } => write!(f, "best-of-n:{worker}"),
            Strategy::Oracle => f.write_str("oracle"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strategies_read_and_print_back() {
        let workers = vec!["a".to_owned(), "b:large".to_owned()];
        let list = Strategy::parse_list(
            "conductor, all-singles, moa,router:lookup,router:random,best-of-n:a:3,best-of-n:b:large,oracle,single:a",
            &workers,
        )
        .unwrap();
        let shown: Vec<String> = list.iter().map(ToString::to_string).collect();
        assert_eq!(
            shown,
            [
                "conductor",
                "single:a",
                "single:b:large",
                "moa",
                "router:lookup",
                "router:random",
                "best-of-n:a:3",
                "best-of-n:b:large",
                "oracle"
            ]
        );
        assert_eq!(list[6].key(), "best-of-n:a");
        assert!(Strategy::parse("single:c", &workers).unwrap_err().contains("no worker \"c\""));
        assert!(Strategy::parse("best-of-n:a:0", &workers).unwrap_err().contains("at least 1"));
        assert!(Strategy::parse("vote", &workers).unwrap_err().contains("unknown strategy"));
        assert!(Strategy::parse_list(" , ", &workers).is_err());
    }
}
