//! Any text: the plan parser returns a plan or an error, never panics or hangs; a plan it
//! accepts prints and parses back to itself.
#![no_main]

use baton_plan::{Limits, parse};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let limits = Limits { max_steps: 8, pool_size: Some(8), allow_stop: true };
    if let Ok(plan) = parse(text, &limits) {
        assert_eq!(parse(&plan.to_python(), &limits), Ok(plan));
    }
});
