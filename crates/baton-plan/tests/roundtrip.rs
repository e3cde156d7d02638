//! Property tests: any valid plan printed in the conductor's format parses back to itself, and
//! no input makes the parser panic.

use baton_plan::{Access, Limits, Plan, Step, parse};
use proptest::prelude::*;

fn arb_plan() -> impl Strategy<Value = Plan> {
    (0usize..=5).prop_flat_map(|n| {
        let steps: Vec<_> = (0..n)
            .map(|i| {
                let access = prop_oneof![
                    Just(Access::All),
                    proptest::collection::vec(0..i.max(1), 0..=i).prop_map(move |v| {
                        // Step 0 can only have an empty list.
                        Access::steps(if i == 0 { vec![] } else { v })
                    }),
                ];
                // Any text, including quotes, backslashes, newlines, tabs and non-ASCII; never blank.
                let subtask = "[\\PC\n\t]*[a-zA-Z\"'\\\\\u{e9}\u{1F600}][\\PC\n\t]*".prop_map(String::from);
                (0usize..50, subtask, access).prop_map(|(model_id, subtask, access)| Step { model_id, subtask, access })
            })
            .collect();
        steps.prop_map(|steps| Plan { steps })
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn print_then_parse_is_identity(plan in arb_plan(), prose in "[a-z ,.]{0,40}") {
        let text = format!("{prose}\n```python\n{}```\n", plan.to_python());
        let parsed = parse(&text, &Limits { max_steps: 5, pool_size: Some(50), allow_stop: true });
        prop_assert_eq!(parsed, Ok(plan));
    }

    #[test]
    fn json_round_trips(plan in arb_plan()) {
        let back: Plan = serde_json::from_str(&plan.to_json()).expect("valid JSON");
        prop_assert_eq!(back, plan);
    }

    #[test]
    fn arbitrary_text_never_panics(text in "\\PC{0,300}") {
        let _ = parse(&text, &Limits::default());
    }

    #[test]
    fn plan_shaped_noise_never_panics(
        text in "(model_id|subtasks|access_list| |=|\\[|\\]|,|'|\"|\\\\|[0-9]|all|\n|#|\\(|\\)|u|r){0,120}"
    ) {
        let _ = parse(&text, &Limits::default());
    }
}
