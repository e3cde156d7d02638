//! What a call costs. Prices come from the genai-prices data set (Pydantic's, MIT, bundled into
//! the binary; it matches dated snapshots, `-pro` variants and provider prefixes, and knows
//! cached-input, cache-write and tiered prices). A pool's `price_in`/`price_out`/
//! `price_cached_in` win over it; a local model costs nothing; a model neither names has no
//! price, and every surface then says "cost unknown" for it rather than showing a low total.

use baton_providers::{ProviderKind, Usage};
use genai_prices::{PriceRequest, UsageKey};
use serde::{Deserialize, Serialize};

/// Prices a pool file gives, in $ per million tokens.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Price {
    pub input: f64,
    pub output: f64,
    /// Input read from a prompt cache; `None` charges it as plain input.
    pub cached_input: Option<f64>,
}

impl Price {
    pub fn cost(&self, usage: &Usage) -> f64 {
        let cached = usage.cached_input_tokens.min(usage.input_tokens);
        let plain = usage.input_tokens - cached;
        (plain as f64 * self.input
            + cached as f64 * self.cached_input.unwrap_or(self.input)
            + usage.output_tokens as f64 * self.output)
            / 1_000_000.0
    }
}

/// How a worker's (or a remote conductor's) calls are priced.
#[derive(Debug, Clone, PartialEq)]
pub enum Pricing {
    /// The pool file's prices.
    Pool(Price),
    /// The genai-prices data: `provider` is the data's provider id, `model` what Baton sends.
    Data { provider: String, model: String },
    /// Runs on this machine: tokens count, dollars do not.
    Free,
    /// Neither the pool nor the data knows this model.
    Unknown,
}

impl Pricing {
    /// The price of `usage`, or `None` when the price is unknown.
    pub fn cost(&self, usage: &Usage) -> Option<f64> {
        match self {
            Pricing::Pool(price) => Some(price.cost(usage)),
            Pricing::Data { provider, model } => data_cost(provider, model, usage),
            Pricing::Free => Some(0.0),
            Pricing::Unknown => None,
        }
    }

    /// The most a call with at most these tokens can cost: every input token at the dearer of
    /// the plain and the cache-write price (tiers follow the input size, so the bound prices
    /// the highest tier the call could reach). `None` when the price is unknown.
    pub fn worst_case(&self, input_tokens: u64, output_tokens: u64) -> Option<f64> {
        let plain = Usage { input_tokens, output_tokens, ..Usage::default() };
        let written = Usage { cache_write_input_tokens: input_tokens, ..plain };
        let a = self.cost(&plain)?;
        Some(self.cost(&written).map_or(a, |b| a.max(b)))
    }

    pub fn is_known(&self) -> bool {
        !matches!(self, Pricing::Unknown)
    }
}

/// The data's provider id for a worker, when the data has one: the three providers by kind,
/// an OpenAI-compatible server only when its URL is a provider the data knows (OpenRouter,
/// Groq, DeepSeek, …), never by model name alone, since a local server may call its model
/// anything.
fn data_provider(kind: ProviderKind, base_url: &str) -> Option<String> {
    match kind {
        ProviderKind::OpenAi => Some("openai".to_owned()),
        ProviderKind::Anthropic => Some("anthropic".to_owned()),
        ProviderKind::Gemini => Some("google".to_owned()),
        ProviderKind::Local => None,
        ProviderKind::OpenAiCompatible => genai_prices::Calculator::bundled()
            .find_provider(None, Some(base_url))
            .ok()
            .flatten()
            .map(|p| p.id().to_owned()),
    }
}

/// How calls to `model` at `base_url` are priced when the pool gives no price.
pub fn lookup(kind: ProviderKind, base_url: &str, model: &str) -> Pricing {
    if kind == ProviderKind::Local {
        return Pricing::Free;
    }
    let model = model.trim_start_matches("models/");
    match data_provider(kind, base_url) {
        Some(provider) if data_cost(&provider, model, &Usage::default()).is_some() => {
            Pricing::Data { provider, model: model.to_owned() }
        }
        _ => Pricing::Unknown,
    }
}

fn data_cost(provider: &str, model: &str, usage: &Usage) -> Option<f64> {
    let cached = usage.cached_input_tokens.min(usage.input_tokens);
    let written = usage.cache_write_input_tokens.min(usage.input_tokens - cached);
    let mut u = genai_prices::Usage::new();
    u.insert(UsageKey::INPUT_TOKENS, usage.input_tokens as f64);
    u.insert(UsageKey::OUTPUT_TOKENS, usage.output_tokens as f64);
    if cached > 0 {
        u.insert(UsageKey::CACHE_READ_TOKENS, cached as f64);
    }
    if written > 0 {
        u.insert(UsageKey::CACHE_WRITE_TOKENS, written as f64);
    }
    genai_prices::calculate(&PriceRequest::new(model, &u).with_provider_id(provider)).ok().map(|p| p.total_price)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn per_million(pricing: &Pricing, input: u64, cached: u64, written: u64, output: u64) -> f64 {
        let usage = Usage {
            input_tokens: input,
            cached_input_tokens: cached,
            cache_write_input_tokens: written,
            output_tokens: output,
            estimated: false,
        };
        pricing.cost(&usage).expect("priced")
    }

    #[test]
    fn pool_prices_charge_cached_input_at_their_own_rate() {
        let p = Price { input: 2.0, output: 10.0, cached_input: Some(0.5) };
        let usage =
            Usage { input_tokens: 1_000_000, cached_input_tokens: 400_000, output_tokens: 500_000, ..Usage::default() };
        assert!((p.cost(&usage) - (0.6 * 2.0 + 0.4 * 0.5 + 5.0)).abs() < 1e-9);
        let plain = Price { cached_input: None, ..p };
        assert!((plain.cost(&usage) - 7.0).abs() < 1e-9, "without a cached price, cached input is plain input");
    }

    /// A handful of models pinned to the data set's published figures ($ per million tokens),
    /// so a data update that changes them, or a matching that picks the wrong entry, is seen.
    #[test]
    fn models_are_priced_as_the_data_says() {
        let million = |kind, model: &str, input, cached, written, output| {
            let pricing = lookup(kind, "", model);
            assert!(matches!(pricing, Pricing::Data { .. }), "{model}: {pricing:?}");
            per_million(&pricing, input, cached, written, output)
        };
        let close = |a: f64, b: f64, what: &str| assert!((a - b).abs() < 1e-9, "{what}: {a} != {b}");
        let m = 1_000_000;
        // `-pro` variants have their own, far higher prices.
        close(million(ProviderKind::OpenAi, "gpt-5", m, 0, 0, m), 1.25 + 10.0, "gpt-5");
        close(million(ProviderKind::OpenAi, "gpt-5-pro", m, 0, 0, m), 15.0 + 120.0, "gpt-5-pro");
        close(million(ProviderKind::OpenAi, "o3-pro", m, 0, 0, m), 20.0 + 80.0, "o3-pro");
        // A dated snapshot finds its model; cached input at its own rate.
        close(million(ProviderKind::OpenAi, "gpt-4o-2024-08-06", m, m / 2, 0, 0), 0.5 * 2.5 + 0.5 * 1.25, "gpt-4o");
        // Anthropic cache reads and writes, and a dated id (below the 200k-token tier)...
        close(
            million(ProviderKind::Anthropic, "claude-sonnet-4-5-20250929", 100_000, 25_000, 25_000, 0),
            0.05 * 3.0 + 0.025 * 0.3 + 0.025 * 3.75,
            "claude-sonnet-4-5",
        );
        // ...and above it, where every part costs its higher rate.
        close(
            million(ProviderKind::Anthropic, "claude-sonnet-4-5", m, m / 4, m / 4, 0),
            0.5 * 6.0 + 0.25 * 0.6 + 0.25 * 7.5,
            "claude-sonnet-4-5, long prompt",
        );
        // Gemini's `models/` prefix; prompts above 200k tokens are priced at the higher tier.
        close(million(ProviderKind::Gemini, "models/gemini-2.5-pro", 100_000, 0, 0, 0), 0.1 * 1.25, "gemini small");
        close(million(ProviderKind::Gemini, "gemini-2.5-pro", 300_000, 0, 0, 0), 0.3 * 2.5, "gemini large");
    }

    #[test]
    fn unknown_and_local_models() {
        assert_eq!(lookup(ProviderKind::OpenAi, "", "no-such-model-xyz"), Pricing::Unknown);
        assert_eq!(lookup(ProviderKind::Local, "", "gpt-4o"), Pricing::Free);
        assert_eq!(
            lookup(ProviderKind::OpenAiCompatible, "http://127.0.0.1:8000/v1", "gpt-4o"),
            Pricing::Unknown,
            "a local server is not priced by its model's name"
        );
        assert_eq!(Pricing::Unknown.worst_case(10, 10), None);
    }

    #[test]
    fn worst_case_bounds_every_split_of_the_same_tokens() {
        let pricing = lookup(ProviderKind::Anthropic, "", "claude-sonnet-4-5");
        assert!(pricing.is_known());
        let worst = pricing.worst_case(10_000, 1_000).unwrap();
        for (cached, written) in [(0, 0), (10_000, 0), (0, 10_000), (5_000, 5_000)] {
            let cost = per_million(&pricing, 10_000, cached, written, 1_000);
            assert!(cost <= worst + 1e-12, "{cached}/{written}: {cost} > {worst}");
        }
    }
}
