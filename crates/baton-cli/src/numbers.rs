//! Flag parsers for numbers with a range ([`baton_engine::limits`]), so a bad value stops the
//! command before it starts: clap's error names the flag and the value, these say the range.

use baton_engine::limits;

/// A spending cap in US dollars: above 0, finite (NaN would cap nothing).
pub fn cost_usd(text: &str) -> Result<f64, String> {
    limits::COST_USD.parse("it", text)
}

/// A sampling temperature.
pub fn temperature(text: &str) -> Result<f64, String> {
    limits::TEMPERATURE.parse("it", text)
}
