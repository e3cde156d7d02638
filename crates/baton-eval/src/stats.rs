//! The statistics an evaluation reports: accuracy with its standard error, paired tests
//! (McNemar's exact test and a paired bootstrap), percentiles, and the cost–accuracy Pareto
//! front with its normalized area (RouterBench's AIQ).

/// Mean of `xs` (0 for none).
pub fn mean(xs: &[f64]) -> f64 {
    if xs.is_empty() { 0.0 } else { xs.iter().sum::<f64>() / xs.len() as f64 }
}

/// Standard error of the mean of per-item scores (each item's score the mean over its
/// repeats, so repeats of one item are not counted as independent items).
pub fn standard_error(per_item: &[f64]) -> f64 {
    let n = per_item.len();
    if n < 2 {
        return 0.0;
    }
    let m = mean(per_item);
    let var = per_item.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (n - 1) as f64;
    (var / n as f64).sqrt()
}

/// The nearest-rank percentile `p` (0–100) of `values`; 0 for none.
pub fn percentile(values: &[u64], p: f64) -> u64 {
    if values.is_empty() {
        return 0;
    }
    let mut v = values.to_vec();
    v.sort_unstable();
    let rank = ((p / 100.0) * v.len() as f64).ceil().max(1.0) as usize;
    v[rank.min(v.len()) - 1]
}

/// McNemar's exact test: `b` pairs where only the first is right, `c` where only the second
/// is. The two-sided p-value of "both are equally good" (a binomial test on the discordant
/// pairs).
pub fn mcnemar_exact(b: u64, c: u64) -> f64 {
    let n = b + c;
    if n == 0 {
        return 1.0;
    }
    let k = b.min(c);
    // Sum of C(n, i) / 2^n for i ≤ k, in logs so thousands of pairs do not overflow.
    let ln_half_n = -(n as f64) * std::f64::consts::LN_2;
    let mut ln_choose = 0.0_f64; // ln C(n, 0)
    let mut tail = 0.0;
    for i in 0..=k {
        if i > 0 {
            ln_choose += ((n - i + 1) as f64).ln() - (i as f64).ln();
        }
        tail += (ln_choose + ln_half_n).exp();
    }
    (2.0 * tail).min(1.0)
}

/// A paired bootstrap of the difference in mean score `a − b` over items.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bootstrap {
    pub difference: f64,
    /// The 95% interval of the difference.
    pub low: f64,
    pub high: f64,
    /// Two-sided: twice the share of resamples on the far side of zero.
    pub p_value: f64,
}

/// Resamples items (with their paired scores) `resamples` times with a fixed seed.
pub fn paired_bootstrap(a: &[f64], b: &[f64], resamples: usize, seed: u64) -> Bootstrap {
    let n = a.len().min(b.len());
    let difference = mean(&a[..n]) - mean(&b[..n]);
    if n == 0 {
        return Bootstrap { difference: 0.0, low: 0.0, high: 0.0, p_value: 1.0 };
    }
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut diffs: Vec<f64> = (0..resamples)
        .map(|_| {
            let mut s = 0.0;
            for _ in 0..n {
                let i = rng.usize(..n);
                s += a[i] - b[i];
            }
            s / n as f64
        })
        .collect();
    diffs.sort_by(f64::total_cmp);
    let at = |q: f64| diffs[((q * (resamples - 1) as f64).round() as usize).min(resamples - 1)];
    let below = diffs.iter().filter(|d| **d <= 0.0).count() as f64 / resamples as f64;
    let above = diffs.iter().filter(|d| **d >= 0.0).count() as f64 / resamples as f64;
    Bootstrap { difference, low: at(0.025), high: at(0.975), p_value: (2.0 * below.min(above)).min(1.0) }
}

/// Indices of the points no other point beats: none is at most as costly and at least as
/// accurate while better in one of the two. Sorted by cost.
pub fn pareto_front(points: &[(f64, f64)]) -> Vec<usize> {
    let mut front: Vec<usize> = (0..points.len())
        .filter(|&i| {
            let (ci, ai) = points[i];
            !points.iter().enumerate().any(|(j, &(cj, aj))| j != i && cj <= ci && aj >= ai && (cj < ci || aj > ai))
        })
        .collect();
    front.sort_by(|&i, &j| points[i].0.total_cmp(&points[j].0).then(points[i].1.total_cmp(&points[j].1)));
    front.dedup_by(|i, j| points[*i] == points[*j]);
    front
}

/// RouterBench's AIQ: the area under the non-decreasing convex hull of the (cost, accuracy)
/// points (any mix of two strategies is reachable by choosing between them per item), over the
/// cost range, divided by that range. With one cost, the best accuracy.
pub fn aiq(points: &[(f64, f64)]) -> f64 {
    if points.is_empty() {
        return 0.0;
    }
    let mut p: Vec<(f64, f64)> = points.to_vec();
    p.sort_by(|a, b| a.0.total_cmp(&b.0).then(b.1.total_cmp(&a.1)));
    let (c_min, c_max) = (p[0].0, p[p.len() - 1].0);
    if c_max - c_min <= f64::EPSILON {
        return p.iter().map(|x| x.1).fold(f64::MIN, f64::max);
    }
    // The upper hull from the cheapest point, up to the most accurate point; flat after it.
    let mut hull: Vec<(f64, f64)> = Vec::new();
    for &q in &p {
        if hull.last().is_some_and(|l| l.0 == q.0) {
            continue; // same cost, lower accuracy (sorted that way)
        }
        while hull.len() >= 2 {
            let (a, b) = (hull[hull.len() - 2], hull[hull.len() - 1]);
            let cross = (b.0 - a.0) * (q.1 - a.1) - (b.1 - a.1) * (q.0 - a.0);
            if cross >= 0.0 {
                hull.pop()
            } else {
                break;
            };
        }
        hull.push(q);
    }
    let best = hull.iter().enumerate().max_by(|a, b| a.1.1.total_cmp(&b.1.1)).map_or(0, |(i, _)| i);
    let mut area = 0.0;
    for w in hull[..=best].windows(2) {
        area += (w[1].0 - w[0].0) * (w[0].1 + w[1].1) / 2.0;
    }
    area += (c_max - hull[best].0) * hull[best].1;
    area / (c_max - c_min)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn standard_error_and_percentiles() {
        assert_eq!(standard_error(&[1.0]), 0.0);
        // p = 0.5 over 4 items: sd 0.577, se 0.289.
        assert!((standard_error(&[1.0, 0.0, 1.0, 0.0]) - 0.288_675).abs() < 1e-5);
        assert_eq!(percentile(&[5, 1, 3, 2, 4], 50.0), 3);
        assert_eq!(percentile(&[5, 1, 3, 2, 4], 95.0), 5);
        assert_eq!(percentile(&[], 50.0), 0);
    }

    #[test]
    fn mcnemar_matches_the_binomial_by_hand() {
        // b=0, c=6: 2 · (1/2)^6 = 0.03125.
        assert!((mcnemar_exact(0, 6) - 0.03125).abs() < 1e-12);
        // b=2, c=8: 2 · (1 + 10 + 45) / 1024 = 0.109375.
        assert!((mcnemar_exact(2, 8) - 0.109_375).abs() < 1e-12);
        assert_eq!(mcnemar_exact(5, 5), 1.0);
        assert_eq!(mcnemar_exact(0, 0), 1.0);
        assert!(mcnemar_exact(100, 3000) < 1e-100);
    }

    #[test]
    fn bootstrap_sees_a_real_difference_and_not_a_tie() {
        let a: Vec<f64> = (0..60).map(|i| if i % 4 == 0 { 0.0 } else { 1.0 }).collect();
        let b: Vec<f64> = (0..60).map(|i| if i % 2 == 0 { 0.0 } else { 1.0 }).collect();
        let r = paired_bootstrap(&a, &b, 2000, 7);
        assert!((r.difference - 0.25).abs() < 1e-12);
        assert!(r.low > 0.0 && r.high > r.low && r.p_value < 0.01, "{r:?}");
        let tie = paired_bootstrap(&a, &a, 500, 7);
        assert_eq!(tie.difference, 0.0);
        assert_eq!(tie.p_value, 1.0);
    }

    #[test]
    fn the_front_and_its_area() {
        let pts = [(1.0, 0.5), (2.0, 0.4), (3.0, 0.8), (4.0, 0.8), (0.5, 0.2)];
        assert_eq!(pareto_front(&pts), vec![4, 0, 2]);
        // Hull: (0.5,0.2) → (1,0.5) → (3,0.8), flat to 4.
        let area = 0.5 * (0.2 + 0.5) / 2.0 + 2.0 * (0.5 + 0.8) / 2.0 + 1.0 * 0.8;
        assert!((aiq(&pts) - area / 3.5).abs() < 1e-12, "{}", aiq(&pts));
        // A point below the segment between two others does not raise the hull.
        let below = [(0.0, 0.0), (1.0, 0.1), (2.0, 1.0)];
        assert!((aiq(&below) - 0.5).abs() < 1e-12);
        assert_eq!(aiq(&[(1.0, 0.3), (1.0, 0.7)]), 0.7);
    }
}
