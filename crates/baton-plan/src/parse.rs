//! Finding the three assignments in a conductor's free-text answer and turning them into a plan.
//!
//! Conductors write reasoning, then the lists, often inside a ```python fence, sometimes a draft
//! followed by a restatement. We scan the whole text for `model_id = …`, `subtasks = …` and
//! `access_list = …`, group consecutive assignments into sets, and take the last complete set.

use crate::literal::{Literal, Spanned, SyntaxError, is_ident_continue, parse_literal, pos_at};
use crate::{Access, Limits, List, Plan, PlanError, Step};

/// Parses and validates a plan from a conductor's answer, or from the JSON object `baton plan
/// --json` prints (a text that is one JSON object and nothing else).
pub fn parse(text: &str, limits: &Limits) -> Result<Plan, PlanError> {
    if let Some(plan) = json_plan(text) {
        let plan = plan?;
        plan.validate(limits)?;
        return Ok(plan);
    }
    let parsed = parse_unchecked(text)?;
    match parsed.plan.validate(limits) {
        Ok(()) => Ok(parsed.plan),
        Err(PlanError::Invalid { list, step, message, .. }) => {
            let pos = match (list, step) {
                (Some(list), Some(step)) => parsed.positions(list).get(step).map(|&at| pos_at(text, at)),
                _ => None,
            };
            Err(PlanError::Invalid { pos, list, step, message })
        }
        Err(other) => Err(other),
    }
}

/// The plan in `text` when `text` is a JSON object (no conductor answers with JSON alone), with
/// serde's message and position when that object is not a plan; `None` for any other text.
fn json_plan(text: &str) -> Option<Result<Plan, PlanError>> {
    let text = text.trim();
    if !text.starts_with('{') || serde_json::from_str::<serde::de::IgnoredAny>(text).is_err() {
        return None;
    }
    Some(serde_json::from_str(text).map_err(|e| PlanError::invalid(None, None, format!("a plan in JSON: {e}"))))
}

/// A plan straight from the text, before range checks, with where each element was written.
struct Parsed {
    plan: Plan,
    /// Byte offsets of each step's element, per list.
    model_id_at: Vec<usize>,
    subtasks_at: Vec<usize>,
    access_at: Vec<usize>,
}

impl Parsed {
    fn positions(&self, list: List) -> &[usize] {
        match list {
            List::ModelId => &self.model_id_at,
            List::Subtasks => &self.subtasks_at,
            List::AccessList => &self.access_at,
        }
    }
}

struct Assignment {
    list: List,
    /// Byte offset of the name.
    at: usize,
    value: Result<Spanned, SyntaxError>,
}

fn parse_unchecked(text: &str) -> Result<Parsed, PlanError> {
    let assignments = find_assignments(text);

    // Group consecutive good assignments into sets; a name seen twice starts a new set. A
    // broken assignment after the last complete set means the conductor's final restatement
    // is broken: report it rather than silently run an earlier draft.
    let mut complete: Option<[Option<&Spanned>; 3]> = None;
    let mut current: [Option<&Spanned>; 3] = [None, None, None];
    let mut error_since_complete: Option<&Assignment> = None;
    let mut any_error: Option<&Assignment> = None;
    for a in &assignments {
        match &a.value {
            Ok(v) => {
                let slot = a.list as usize;
                if current[slot].is_some() {
                    current = [None, None, None];
                }
                current[slot] = Some(v);
                if current.iter().all(Option::is_some) {
                    complete = Some(current);
                    current = [None, None, None];
                    error_since_complete = None;
                }
            }
            Err(_) => {
                error_since_complete = Some(a);
                any_error = Some(a);
            }
        }
    }
    let syntax = |a: &Assignment| match &a.value {
        Err(e) => PlanError::Syntax { list: a.list, pos: pos_at(text, e.at), message: e.message.clone() },
        Ok(_) => PlanError::NotFound,
    };
    if let Some(a) = error_since_complete.filter(|_| complete.is_some()) {
        return Err(syntax(a));
    }

    let Some([Some(ids), Some(subtasks), Some(access)]) = complete else {
        if let Some(a) = any_error {
            return Err(syntax(a));
        }
        let found: Vec<&str> = List::ALL
            .iter()
            .filter(|l| assignments.iter().any(|a| a.list == **l && a.value.is_ok()))
            .map(|l| l.name())
            .collect();
        if found.is_empty() {
            return Err(PlanError::NotFound);
        }
        let missing: Vec<&str> = List::ALL.iter().map(|l| l.name()).filter(|n| !found.contains(n)).collect();
        if missing.is_empty() {
            return Err(PlanError::invalid(
                None,
                None,
                "`model_id`, `subtasks` and `access_list` never appear together as one set; write each once, in one place",
            ));
        }
        return Err(PlanError::Incomplete { found: join_names(&found), missing: join_names(&missing) });
    };

    let ids = elements(text, List::ModelId, ids)?;
    let subtasks = elements(text, List::Subtasks, subtasks)?;
    let access = elements(text, List::AccessList, access)?;
    if ids.len() != subtasks.len() || subtasks.len() != access.len() {
        return Err(PlanError::Invalid {
            pos: None,
            list: None,
            step: None,
            message: format!(
                "the three lists differ in length: model_id has {}, subtasks {}, access_list {}",
                ids.len(),
                subtasks.len(),
                access.len()
            ),
        });
    }

    let mut steps = Vec::with_capacity(ids.len());
    for (i, ((id, subtask), acc)) in ids.iter().zip(subtasks.iter()).zip(access.iter()).enumerate() {
        let model_id = match id.value {
            Literal::Int(n) if n >= 0 => n as usize,
            Literal::Int(n) => {
                return Err(element_error(text, List::ModelId, i, id, format!("{n} is not a worker number")));
            }
            ref other => {
                return Err(element_error(
                    text,
                    List::ModelId,
                    i,
                    id,
                    format!("expected a worker number, found {}", other.describe()),
                ));
            }
        };
        let subtask = match &subtask.value {
            Literal::Str(s) => s.clone(),
            other => {
                return Err(element_error(
                    text,
                    List::Subtasks,
                    i,
                    subtask,
                    format!("expected a string, found {}", other.describe()),
                ));
            }
        };
        let access_entry = match &acc.value {
            Literal::Str(s) if s.trim().eq_ignore_ascii_case("all") => Access::All,
            Literal::Seq(items) => {
                let mut indices = Vec::with_capacity(items.len());
                for item in items {
                    match item.value {
                        Literal::Int(n) if n >= 0 => indices.push(n as usize),
                        ref other => {
                            return Err(element_error(
                                text,
                                List::AccessList,
                                i,
                                item,
                                format!("expected a step number, found {}", other.describe()),
                            ));
                        }
                    }
                }
                Access::steps(indices)
            }
            other => {
                return Err(element_error(
                    text,
                    List::AccessList,
                    i,
                    acc,
                    format!("expected \"all\" or a list of step numbers, found {}", other.describe()),
                ));
            }
        };
        steps.push(Step { model_id, subtask, access: access_entry });
    }

    Ok(Parsed {
        plan: Plan { steps },
        model_id_at: ids.iter().map(|s| s.start).collect(),
        subtasks_at: subtasks.iter().map(|s| s.start).collect(),
        access_at: access.iter().map(|s| s.start).collect(),
    })
}

fn join_names(names: &[&str]) -> String {
    names.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(" and ")
}

fn elements<'a>(text: &str, list: List, value: &'a Spanned) -> Result<&'a [Spanned], PlanError> {
    match &value.value {
        Literal::Seq(items) => Ok(items),
        other => Err(PlanError::Invalid {
            pos: Some(pos_at(text, value.start)),
            list: Some(list),
            step: None,
            message: format!("expected a list, found {}", other.describe()),
        }),
    }
}

fn element_error(text: &str, list: List, step: usize, at: &Spanned, message: String) -> PlanError {
    PlanError::Invalid { pos: Some(pos_at(text, at.start)), list: Some(list), step: Some(step), message }
}

/// Every `NAME = <literal>` in the text for the three list names, in order.
fn find_assignments(text: &str) -> Vec<Assignment> {
    let mut out = Vec::new();
    let mut from = 0;
    while from < text.len() {
        let Some((list, at)) = next_name(text, from) else { break };
        let after_name = at + list.name().len();
        let Some(value_at) = assignment_value(text, after_name) else {
            from = after_name;
            continue;
        };
        match parse_literal(text, value_at) {
            Ok((value, end)) => {
                out.push(Assignment { list, at, value: Ok(value) });
                // Continue after the literal, so names quoted inside a subtask are not mistaken
                // for assignments.
                from = end;
            }
            Err(e) => {
                out.push(Assignment { list, at, value: Err(e) });
                from = after_name;
            }
        }
    }
    out.sort_by_key(|a| a.at);
    out
}

/// The next whole-word occurrence of one of the three names at or after `from`.
fn next_name(text: &str, from: usize) -> Option<(List, usize)> {
    let hay = &text[from..];
    List::ALL
        .iter()
        .filter_map(|&list| {
            let mut search = 0;
            while let Some(found) = hay[search..].find(list.name()) {
                let at = from + search + found;
                let end = at + list.name().len();
                let before_ok = !text[..at].chars().next_back().is_some_and(is_ident_continue);
                let after_ok = !text[end..].chars().next().is_some_and(is_ident_continue);
                if before_ok && after_ok {
                    return Some((list, at));
                }
                search += found + list.name().len();
            }
            None
        })
        .min_by_key(|&(_, at)| at)
}

/// If `NAME` ends at `after_name` and is followed by `=` (not `==`) and something that starts a
/// literal, returns the offset of that literal. Prose such as "model_id = the worker" is skipped.
fn assignment_value(text: &str, after_name: usize) -> Option<usize> {
    let rest = &text[after_name..];
    let trimmed = rest.trim_start_matches([' ', '\t']);
    let eq = trimmed.strip_prefix('=')?;
    if eq.starts_with('=') {
        return None;
    }
    let value = eq.trim_start();
    let value_at = text.len() - value.len();
    match value.chars().next()? {
        '[' | '(' | '"' | '\'' => Some(value_at),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Pos;

    fn ok(text: &str) -> Plan {
        parse(text, &Limits::default()).unwrap_or_else(|e| panic!("{e}"))
    }

    fn fail(text: &str) -> PlanError {
        parse(text, &Limits { pool_size: Some(3), ..Limits::default() }).expect_err("must fail")
    }

    #[test]
    fn paper_example_in_a_fence() {
        let text = "I'll have model 2 solve it, then check.\n```python\nmodel_id = [2, 0, 1]\n\
            subtasks = [\"Solve ...\", 'Check the solution above for errors; if ...', \"\"\"Write the final ...\"\"\"]\n\
            access_list = [[], \"all\", [0, 1]]\n```\n";
        let plan = ok(text);
        assert_eq!(plan.steps.len(), 3);
        assert_eq!(plan.steps[0].model_id, 2);
        assert_eq!(plan.steps[1].access, Access::All);
        assert_eq!(plan.steps[2].access, Access::Steps(vec![0, 1]));
        assert_eq!(
            plan.to_json(),
            r#"{"model_id":[2,0,1],"subtasks":["Solve ...","Check the solution above for errors; if ...","Write the final ..."],"access_list":[[],"all",[0,1]]}"#
        );
    }

    #[test]
    fn the_json_the_command_line_prints_reads_back() {
        let plan = ok("model_id = [2, 0]\nsubtasks = ['a', 'b']\naccess_list = [[], 'all']");
        let printed = format!("{{\"version\":{},{}", crate::JSON_VERSION, &plan.to_json()[1..]);
        assert_eq!(ok(&format!("  {printed}\n")), plan);
        assert_eq!(ok(&plan.to_json()), plan, "without a version, as the history keeps plans");
        // Checked as a written plan is: against the pool and the limits.
        let e = fail(r#"{"version":1,"model_id":[3],"subtasks":["x"],"access_list":[[]]}"#);
        assert!(e.to_string().contains("model_id[0]: model 3 is not in the pool"), "{e}");
        let e = fail(r#"{"version":2,"model_id":[0],"subtasks":["x"],"access_list":[[]]}"#);
        assert!(e.to_string().contains("the plan is JSON version 2, newer than this Baton reads"), "{e}");
        let e = fail(r#"{"model_id":[0],"subtasks":["x"],"access_list":[[]],"steps":1}"#);
        assert!(e.to_string().starts_with("a plan in JSON: unknown field `steps`"), "{e}");
        // Not JSON: the conductor's text, read as before.
        assert_eq!(ok("{model_id = [0]\nsubtasks = ['x']\naccess_list = [[]]}").steps.len(), 1);
    }

    #[test]
    fn last_complete_set_wins() {
        let text = "Draft:\nmodel_id = [0]\nsubtasks = ['a']\naccess_list = [[]]\n\
            Better:\nmodel_id = [1, 0]\nsubtasks = ['b', 'c']\naccess_list = [[], 'all']\n";
        let plan = ok(text);
        assert_eq!(plan.steps.len(), 2);
        assert_eq!(plan.steps[0].subtask, "b");
    }

    #[test]
    fn incomplete_restatement_does_not_mix_sets() {
        let text = "model_id = [0]\nsubtasks = ['a']\naccess_list = [[]]\nmodel_id = [1]\n";
        let plan = ok(text);
        assert_eq!(plan.steps[0].model_id, 0);
    }

    #[test]
    fn a_broken_restatement_is_reported_not_replaced_by_the_draft() {
        let text = "model_id = [0]\nsubtasks = ['draft']\naccess_list = [[]]\nFinal:\nmodel_id = [1]\nsubtasks = ['final\naccess_list = [[]]";
        let e = parse(text, &Limits::default()).expect_err("the final plan is broken");
        assert!(matches!(e, PlanError::Syntax { list: List::Subtasks, pos: Pos { line: 6, column: 13 }, .. }), "{e:?}");
        // A broken draft before a good final plan does not matter.
        let text = "model_id = [0\nmodel_id = [1]\nsubtasks = ['ok']\naccess_list = [[]]";
        assert_eq!(ok(text).steps[0].model_id, 1);
    }

    #[test]
    fn scattered_assignments_are_explained() {
        let e = fail("model_id = [0]\nsubtasks = ['a']\nmodel_id = [0]\naccess_list = [[]]");
        assert!(e.to_string().contains("never appear together"), "{e}");
    }

    #[test]
    fn names_inside_subtasks_are_not_assignments() {
        let text = "model_id = [0]\nsubtasks = ['Explain what model_id = [5] means']\naccess_list = [[]]";
        assert_eq!(ok(text).steps[0].model_id, 0);
    }

    #[test]
    fn three_empty_lists_are_a_stop() {
        assert!(ok("model_id = []\nsubtasks = []\naccess_list = []").is_stop());
        let limits = Limits { allow_stop: false, ..Limits::default() };
        assert!(parse("model_id = []\nsubtasks = []\naccess_list = []", &limits).is_err());
    }

    #[test]
    fn errors_say_where() {
        let e = fail("model_id = [0, 7]\nsubtasks = ['a', 'b']\naccess_list = [[], [0]]");
        assert_eq!(
            e.to_string(),
            "line 1, column 16: model_id[1]: model 7 is not in the pool; the pool has 3 workers (0..=2)"
        );
        let e = fail("model_id = [0, 1]\nsubtasks = ['a', 'b']\naccess_list = [[], [1]]");
        assert!(e.to_string().starts_with("line 3, column 20: access_list[1]:"), "{e}");
        let e = fail("model_id = [0, 1]\nsubtasks = ['a', 'b'\naccess_list = [[], [0]]");
        assert!(matches!(e, PlanError::Syntax { list: List::Subtasks, .. }), "{e:?}");
        let e = fail("model_id = [0, 1]\nsubtasks = ['a']\naccess_list = [[], [0]]");
        assert!(e.to_string().contains("differ in length"), "{e}");
        let e = fail("just prose");
        assert_eq!(e, PlanError::NotFound);
        let e = fail("model_id = [0]\nsubtasks = ['a']");
        assert!(e.to_string().contains("`access_list`"), "{e}");
        let e = fail("model_id = [0]\nsubtasks = [3]\naccess_list = [[]]");
        assert!(e.to_string().contains("subtasks[0]: expected a string, found the number 3"), "{e}");
        let e = fail("model_id = [0, 0, 0, 0, 0, 0]\nsubtasks = ['a']*6\naccess_list = []");
        assert!(e.to_string().contains("differ in length"), "{e}");
    }

    #[test]
    fn too_many_steps() {
        let text = "model_id = [0,0,0,0,0,0]\nsubtasks = ['a','b','c','d','e','f']\naccess_list = [[],[],[],[],[],[]]";
        let e = parse(text, &Limits::default()).expect_err("6 > 5");
        assert!(e.to_string().contains("at most 5"), "{e}");
    }
}
