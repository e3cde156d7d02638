//! The Lark grammar (llguidance dialect) that makes a conductor's output always a valid plan
//! for the current pool: bounded free reasoning, then the three lists in a ```python block with
//! model ids from the allowed set, 1 to `max_steps` entries (0 only for a stop), and access
//! entries that name earlier steps only.
//!
//! Every repetition is bounded: an unbounded one lets a weak model ramble to the length cap.

use std::fmt::Write;

/// What the grammar allows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanGrammar {
    /// Worker numbers the plan may use (the pool's, plus the conductor's own on recursive pools).
    pub model_ids: Vec<usize>,
    pub max_steps: usize,
    /// Whether three empty lists are allowed (recursive rounds only).
    pub allow_stop: bool,
    /// Longest reasoning before the lists, in characters.
    pub max_reasoning_chars: usize,
    /// Longest subtask, in characters.
    pub max_subtask_chars: usize,
}

impl PlanGrammar {
    pub fn to_lark(&self) -> String {
        let mut g = String::new();
        let step_counts: Vec<usize> = (if self.allow_stop { 0 } else { 1 }..=self.max_steps).collect();
        // The reasoning may not contain a backtick, so the code fence is unambiguous.
        let _ = writeln!(g, "start: REASONING \"\\n```python\\n\" plan \"\\n```\"");
        let _ = writeln!(g, "REASONING: /[^`]{{0,{}}}/", self.max_reasoning_chars);
        let plans: Vec<String> = step_counts.iter().map(|n| format!("plan_{n}")).collect();
        let _ = writeln!(g, "plan: {}", plans.join(" | "));
        for &n in &step_counts {
            let ids = vec!["id"; n].join(" \", \" ");
            let subtasks = vec!["SUBTASK"; n].join(" \", \" ");
            let access: Vec<String> = (0..n).map(|i| format!("access_{i}")).collect();
            let access = access.join(" \", \" ");
            let _ = writeln!(
                g,
                "plan_{n}: \"model_id = [\" {ids} \"]\\nsubtasks = [\" {subtasks} \"]\\naccess_list = [\" {access} \"]\""
            );
        }
        let ids: Vec<String> = self.model_ids.iter().map(|i| format!("\"{i}\"")).collect();
        let _ = writeln!(g, "id: {}", ids.join(" | "));
        // Double-quoted, no escapes needed: no quote, backslash or line break inside.
        let _ = writeln!(g, "SUBTASK: /\"[^\"\\\\\\n\\r]{{1,{}}}\"/", self.max_subtask_chars);
        let needed = step_counts.iter().copied().max().unwrap_or(0);
        for i in 0..needed {
            if i == 0 {
                let _ = writeln!(g, "access_0: \"[]\" | \"\\\"all\\\"\"");
                continue;
            }
            let earlier: Vec<String> = (0..i).map(|j| format!("\"{j}\"")).collect();
            let _ = writeln!(g, "earlier_{i}: {}", earlier.join(" | "));
            // llguidance rejects a {0,0} repetition, so step 1's list is written out.
            let more = if i > 1 { format!(" (\", \" earlier_{i}){{0,{}}}", i - 1) } else { String::new() };
            let _ = writeln!(g, "access_{i}: \"[]\" | \"\\\"all\\\"\" | \"[\" earlier_{i}{more} \"]\"");
        }
        g
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grammar_names_every_allowed_piece() {
        let g = PlanGrammar {
            model_ids: vec![0, 1, 2],
            max_steps: 3,
            allow_stop: false,
            max_reasoning_chars: 100,
            max_subtask_chars: 50,
        }
        .to_lark();
        assert!(g.contains("plan: plan_1 | plan_2 | plan_3\n"), "{g}");
        assert!(g.contains("id: \"0\" | \"1\" | \"2\"\n"), "{g}");
        assert!(g.contains("earlier_2: \"0\" | \"1\"\n"), "{g}");
        assert!(g.contains("REASONING: /[^`]{0,100}/"), "{g}");
        assert!(!g.contains("plan_0"), "no stop outside recursion");
        let stop = PlanGrammar {
            allow_stop: true,
            ..PlanGrammar {
                model_ids: vec![0],
                max_steps: 1,
                allow_stop: false,
                max_reasoning_chars: 1,
                max_subtask_chars: 1,
            }
        };
        assert!(stop.to_lark().contains("plan: plan_0 | plan_1"));
    }
}
