//! The ranges the numbers a user gives Baton must fall in, wherever they are given: the pool
//! file, a command-line flag, an `x-baton-*` header, the app's settings. One place, so the
//! same number is never taken in one and refused in another.
//!
//! Every range is finite at both ends. A comparison with NaN is always false, so a NaN cap
//! would cap nothing (`spent > max` never holds); infinity would too. Both are refused, as is
//! a cap of 0 or below, which would refuse every request.

use std::fmt;

/// Where a number may lie: above (or at) `min`, at most `max`, in `unit`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Range {
    pub min: f64,
    /// `min` itself is refused (a cap of $0 would refuse everything).
    pub above_min: bool,
    pub max: f64,
    /// What the number counts, for the message: "US dollars".
    pub unit: &'static str,
}

/// A spending cap: a run's, an evaluation's, a learning run's or the day's.
pub const COST_USD: Range = Range { min: 0.0, above_min: true, max: 1_000_000.0, unit: "US dollars" };

/// A worker's price per million tokens (input, output or cached input). The dearest models
/// cost hundreds of dollars per million tokens; ten thousand is a typo.
pub const PRICE_PER_MILLION: Range =
    Range { min: 0.0, above_min: false, max: 10_000.0, unit: "US dollars per million tokens" };

/// A sampling temperature, as the providers take it (OpenAI's range; Anthropic's is 0 to 1).
pub const TEMPERATURE: Range = Range { min: 0.0, above_min: false, max: 2.0, unit: "" };

/// Nucleus sampling's share of the probability mass.
pub const TOP_P: Range = Range { min: 0.0, above_min: false, max: 1.0, unit: "" };

/// A share of a suite's items (an evaluation's calibration share).
pub const SHARE: Range = Range { min: 0.0, above_min: true, max: 1.0, unit: "" };

impl Range {
    /// `value` where it is in range, else a message naming `name` (the flag, key or header, as
    /// the user wrote it) and the range.
    pub fn check(&self, name: &str, value: f64) -> Result<f64, String> {
        let low_ok = if self.above_min { value > self.min } else { value >= self.min };
        if value.is_finite() && low_ok && value <= self.max {
            Ok(value)
        } else {
            Err(format!("{name} must be {self}; got {value}"))
        }
    }

    /// Reads `text` as a number in range; an error names `name` and the range.
    pub fn parse(&self, name: &str, text: &str) -> Result<f64, String> {
        let value: f64 =
            text.trim().parse().map_err(|_| format!("{name} must be {self}; got {:?}, which is not a number", text))?;
        self.check(name, value)
    }
}

impl fmt::Display for Range {
    /// "a number above 0 and at most 1000000 (US dollars)".
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let low = if self.above_min { "above" } else { "at least" };
        write!(f, "a number {low} {} and at most {}", self.min, self.max)?;
        if !self.unit.is_empty() {
            write!(f, " ({})", self.unit)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_number_out_of_range_is_refused_by_name_with_the_range() {
        assert_eq!(COST_USD.check("--max-cost-usd", 0.5), Ok(0.5));
        for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 0.0, -1.0, 2_000_000.0] {
            let e = COST_USD.check("--daily-max-cost-usd", bad).expect_err("refused");
            assert!(
                e.starts_with("--daily-max-cost-usd must be a number above 0 and at most 1000000 (US dollars); got"),
                "{e}"
            );
        }
        assert_eq!(TEMPERATURE.check("temperature", 0.0), Ok(0.0), "0 is greedy, and allowed");
        assert!(TEMPERATURE.check("temperature", 2.5).is_err());
        assert_eq!(COST_USD.parse("x-baton-max-cost-usd", " 0.25 "), Ok(0.25));
        for text in ["nan", "inf", "infinity", "-0.1", "1e9", "ten", ""] {
            let e = COST_USD.parse("x-baton-max-cost-usd", text).expect_err(text);
            assert!(e.starts_with("x-baton-max-cost-usd must be a number above 0"), "{text}: {e}");
        }
    }
}
