//! Built-in list prices ($ per million tokens), used when a pool gives none. Prices change:
//! a pool's `price_in`/`price_out` always win, and an unknown model simply has no cost.

use baton_providers::{ProviderKind, Usage};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Price {
    /// $ per million input tokens.
    pub input: f64,
    /// $ per million output tokens.
    pub output: f64,
}

impl Price {
    pub fn cost(&self, usage: &Usage) -> f64 {
        (usage.input_tokens as f64 * self.input + usage.output_tokens as f64 * self.output) / 1_000_000.0
    }
}

/// Model-name prefixes and their prices; the longest matching prefix wins, so dated snapshots
/// (`gpt-4o-2024-08-06`) find their family.
const TABLE: &[(ProviderKind, &str, f64, f64)] = &[
    (ProviderKind::OpenAi, "gpt-5", 1.25, 10.0),
    (ProviderKind::OpenAi, "gpt-5-mini", 0.25, 2.0),
    (ProviderKind::OpenAi, "gpt-5-nano", 0.05, 0.40),
    (ProviderKind::OpenAi, "gpt-4.1", 2.0, 8.0),
    (ProviderKind::OpenAi, "gpt-4.1-mini", 0.40, 1.60),
    (ProviderKind::OpenAi, "gpt-4.1-nano", 0.10, 0.40),
    (ProviderKind::OpenAi, "gpt-4o", 2.50, 10.0),
    (ProviderKind::OpenAi, "gpt-4o-mini", 0.15, 0.60),
    (ProviderKind::OpenAi, "o3", 2.0, 8.0),
    (ProviderKind::OpenAi, "o4-mini", 1.10, 4.40),
    (ProviderKind::Anthropic, "claude-opus-4", 15.0, 75.0),
    (ProviderKind::Anthropic, "claude-sonnet-4", 3.0, 15.0),
    (ProviderKind::Anthropic, "claude-haiku-4", 1.0, 5.0),
    (ProviderKind::Anthropic, "claude-3-5-haiku", 0.80, 4.0),
    (ProviderKind::Gemini, "gemini-2.5-pro", 1.25, 10.0),
    (ProviderKind::Gemini, "gemini-2.5-flash", 0.30, 2.50),
    (ProviderKind::Gemini, "gemini-2.5-flash-lite", 0.10, 0.40),
    (ProviderKind::Gemini, "gemini-2.0-flash", 0.10, 0.40),
];

pub fn lookup(provider: ProviderKind, model: &str) -> Option<Price> {
    let model = model.trim_start_matches("models/");
    TABLE
        .iter()
        .filter(|(p, prefix, _, _)| *p == provider && model.starts_with(prefix))
        .max_by_key(|(_, prefix, _, _)| prefix.len())
        .map(|&(_, _, input, output)| Price { input, output })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longest_prefix_wins() {
        assert_eq!(lookup(ProviderKind::OpenAi, "gpt-4o-mini-2024-07-18").map(|p| p.input), Some(0.15));
        assert_eq!(lookup(ProviderKind::OpenAi, "gpt-4o-2024-08-06").map(|p| p.input), Some(2.50));
        assert_eq!(lookup(ProviderKind::OpenAiCompatible, "gpt-4o"), None, "a compatible server sets its own prices");
        let p = Price { input: 2.0, output: 10.0 };
        let cost = p.cost(&Usage { input_tokens: 1_000_000, output_tokens: 500_000, cached_input_tokens: 0 });
        assert!((cost - 7.0).abs() < 1e-9);
    }
}
