//! Which items an evaluation runs, and which of them are calibration: stratified by category
//! and seeded, so a resume (and anyone repeating the evaluation) gets the same ones.

use std::collections::BTreeMap;

use crate::suite::Item;

/// `limit` items drawn round-robin across categories, each category shuffled with `seed`, so
/// every category keeps its share. All items (in file order) without a limit.
pub(super) fn select(items: &[Item], limit: Option<usize>, seed: u64) -> Vec<Item> {
    let Some(limit) = limit.filter(|l| *l < items.len()) else { return items.to_vec() };
    let mut groups: BTreeMap<&str, Vec<&Item>> = BTreeMap::new();
    for item in items {
        groups.entry(item.stratum()).or_default().push(item);
    }
    let mut rng = fastrand::Rng::with_seed(seed);
    for g in groups.values_mut() {
        rng.shuffle(g);
    }
    let mut out = Vec::new();
    let mut round = 0;
    while out.len() < limit {
        for g in groups.values() {
            if let Some(item) = g.get(round)
                && out.len() < limit
            {
                out.push((*item).clone());
            }
        }
        round += 1;
    }
    out
}

/// The share of calibration items when the suite pins its items to splits (any item has
/// `split`), else `None`.
pub(super) fn pinned_share(items: &[Item]) -> Option<f64> {
    if !items.iter().any(|i| i.split.is_some()) {
        return None;
    }
    let calibration = items.iter().filter(|i| i.split.as_deref() == Some("calibration")).count();
    Some(calibration as f64 / items.len().max(1) as f64)
}

/// The items' own splits when the suite pins them (see [`Item::split`]); else marks `fraction`
/// of each category (rounded, at least one where a category has two or more items and the
/// fraction is not zero) as calibration.
pub(super) fn split(items: &[Item], fraction: f64, seed: u64) -> Vec<bool> {
    if items.iter().any(|i| i.split.is_some()) {
        return items.iter().map(|i| i.split.as_deref() == Some("calibration")).collect();
    }
    let mut out = vec![false; items.len()];
    if fraction <= 0.0 {
        return out;
    }
    let mut groups: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    for (i, item) in items.iter().enumerate() {
        groups.entry(item.stratum()).or_default().push(i);
    }
    let mut rng = fastrand::Rng::with_seed(seed ^ 0x5eed_ca1b);
    for g in groups.values_mut() {
        rng.shuffle(g);
        let take = if g.len() >= 2 { ((g.len() as f64 * fraction).round() as usize).clamp(1, g.len() - 1) } else { 0 };
        for &i in &g[..take] {
            out[i] = true;
        }
    }
    out
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::suite::Kind;

    /// An item of `category` (shared with the other modules' tests).
    pub(in crate::harness) fn item(id: &str, category: &str) -> Item {
        Item {
            id: id.into(),
            question: format!("q {id}"),
            answer: "1".into(),
            kind: Kind::Number,
            category: Some(category.into()),
            choices: None,
            entry_point: None,
            tests: None,
            prompt: None,
            split: None,
        }
    }

    #[test]
    fn items_that_name_their_split_keep_it() {
        let mut items: Vec<Item> = (0..10).map(|i| item(&i.to_string(), "a")).collect();
        assert_eq!(pinned_share(&items), None);
        items[3].split = Some("calibration".into());
        items[7].split = Some("calibration".into());
        items[0].split = Some("test".into());
        assert_eq!(pinned_share(&items), Some(0.2));
        let cal = split(&items, 0.5, 1);
        let marked: Vec<usize> = (0..10).filter(|i| cal[*i]).collect();
        assert_eq!(marked, [3, 7], "exactly the pinned items, whatever the fraction or seed");
    }

    #[test]
    fn selection_and_splits_are_stratified_and_seeded() {
        let items: Vec<Item> = (0..30).map(|i| item(&i.to_string(), if i < 20 { "a" } else { "b" })).collect();
        let picked = select(&items, Some(9), 1);
        assert_eq!(picked.len(), 9);
        let b = picked.iter().filter(|i| i.stratum() == "b").count();
        assert!((4..=5).contains(&b), "{b}");
        assert_eq!(picked, select(&items, Some(9), 1));
        let cal = split(&items, 0.3, 1);
        let in_a = items.iter().zip(&cal).filter(|(i, c)| **c && i.stratum() == "a").count();
        let in_b = items.iter().zip(&cal).filter(|(i, c)| **c && i.stratum() == "b").count();
        assert_eq!((in_a, in_b), (6, 3));
        assert!(split(&items, 0.0, 1).iter().all(|c| !c));
    }
}
