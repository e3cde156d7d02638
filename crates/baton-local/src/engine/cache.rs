//! A mirror of the finished sequences whose attention caches the engine keeps, so that each
//! generation can say how much of its prompt it read from there (mistral.rs does not say).

use std::collections::VecDeque;
use std::sync::{Mutex, PoisonError};

pub(super) struct PrefixMirror {
    /// Newest last, at most `capacity`, as the engine evicts the oldest first.
    sequences: Mutex<VecDeque<Vec<u32>>>,
    capacity: usize,
    /// The positions the model's sliding-window layers keep, when it has such layers.
    window: Option<usize>,
}

impl PrefixMirror {
    pub(super) fn new(capacity: usize, window: Option<usize>) -> Self {
        PrefixMirror { sequences: Mutex::new(VecDeque::new()), capacity, window }
    }

    /// How many of `prompt`'s tokens the engine reads from its cache: the longest prefix a kept
    /// sequence shares with it, as mistral.rs's prefix cacher matches it.
    pub(super) fn cached_prefix(&self, prompt: &[u32]) -> usize {
        let sequences = self.sequences.lock().unwrap_or_else(PoisonError::into_inner);
        sequences.iter().map(|sequence| reusable(sequence, prompt, self.window)).max().unwrap_or(0)
    }

    pub(super) fn remember(&self, sequence: Vec<u32>) {
        let mut sequences = self.sequences.lock().unwrap_or_else(PoisonError::into_inner);
        if sequences.len() == self.capacity {
            sequences.pop_front();
        }
        sequences.push_back(sequence);
    }
}

/// What one kept sequence's cache gives `prompt`: the prefix they share, within what the cache
/// covers (all but the sequence's last token, which was sampled and never forwarded) and at most
/// the prompt less its last token, which is forwarded for the next token's logits (vendor
/// mistral.rs change 7). A sliding-window layer keeps only its last `window` positions, and a
/// cache that outgrew them cannot be cut back: it serves only a prompt that continues all of it
/// (Gemma 3 270M's window of 512 is shorter than a plan's prompt, so its plans share nothing).
fn reusable(sequence: &[u32], prompt: &[u32], window: Option<usize>) -> usize {
    let covered = sequence.len().saturating_sub(1);
    let shared = sequence.iter().zip(prompt).take_while(|(a, b)| a == b).count();
    let reused = shared.min(covered).min(prompt.len().saturating_sub(1));
    let rolled_over = window.is_some_and(|w| covered > w);
    if rolled_over && reused < covered { 0 } else { reused }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_prefix_is_reused_up_to_the_prompt_less_its_last_token() {
        let mirror = PrefixMirror::new(8, None);
        mirror.remember(vec![1, 2, 3, 4, 5, 6]);
        assert_eq!(mirror.cached_prefix(&[1, 2, 3, 9, 9]), 3);
        // The same prompt again: all but its last token.
        assert_eq!(mirror.cached_prefix(&[1, 2, 3, 4, 5, 6]), 5);
        assert_eq!(mirror.cached_prefix(&[7, 8]), 0);
    }

    #[test]
    fn a_sequence_covers_all_but_its_last_token() {
        let mirror = PrefixMirror::new(8, None);
        mirror.remember(vec![1, 2, 3]);
        assert_eq!(mirror.cached_prefix(&[1, 2, 3, 4, 5]), 2);
    }

    #[test]
    fn a_cache_that_outgrew_its_window_serves_only_its_continuation() {
        let long: Vec<u32> = (0..20).collect();
        let mirror = PrefixMirror::new(8, Some(10));
        mirror.remember(long.clone());
        let mut question = long[..12].to_vec();
        question.push(99);
        assert_eq!(mirror.cached_prefix(&question), 0, "shares 12 of 19 covered positions");
        let mut follow_up = long.clone();
        follow_up.extend([30, 31]);
        assert_eq!(mirror.cached_prefix(&follow_up), 19, "continues the whole sequence");
        // Within its window a sequence is cut back like any other.
        let short = PrefixMirror::new(8, Some(10));
        short.remember(long[..8].to_vec());
        assert_eq!(short.cached_prefix(&[0, 1, 2, 3, 50]), 4);
    }

    #[test]
    fn the_oldest_sequence_goes_first() {
        let mirror = PrefixMirror::new(2, None);
        mirror.remember(vec![1, 1, 1]);
        mirror.remember(vec![2, 2, 2]);
        mirror.remember(vec![3, 3, 3]);
        assert_eq!(mirror.cached_prefix(&[1, 1, 1, 0]), 0);
        assert_eq!(mirror.cached_prefix(&[2, 2, 2, 0]), 2);
    }
}
