//! The grammar that makes a conductor's output always a valid plan for the current pool:
//! bounded free reasoning, then the three lists in a ```python block with model ids from the
//! allowed set, 1 to `max_steps` entries (0 only for a stop), and access entries that name
//! earlier steps only.
//!
//! The language is finite, so one description renders to three dialects: Lark for llguidance
//! (the local conductor), a regular expression (vLLM's and SGLang's structured outputs) and GBNF
//! (llama.cpp's server). Every repetition is bounded: an unbounded one lets a weak model ramble
//! to the length cap.

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

// The fixed text around the pieces. The reasoning may not contain a backtick, so the code fence
// is unambiguous; a subtask is double-quoted with no quote, backslash or line break inside, so it
// needs no escapes.
const FENCE_OPEN: &str = "\n```python\n";
/// Ends every plan, and only at its end: the reasoning has no backtick and a subtask no line
/// break, so a text that ends with this is a complete plan.
pub const FENCE_CLOSE: &str = "\n```";
const MODEL_ID: &str = "model_id = [";
const SUBTASKS: &str = "]\nsubtasks = [";
const ACCESS: &str = "]\naccess_list = [";
const CLOSE: &str = "]";
const SEP: &str = ", ";
const NO_ACCESS: &str = "[]";
const ALL: &str = "\"all\"";
/// A subtask's first character: not blank, since the plan validator rejects a subtask that is
/// only whitespace (Unicode White_Space, as Rust's `str::trim` sees it). The escapes are ones
/// that Rust's and Python's regex syntax, llguidance and GBNF all read the same way.
const SUBTASK_FIRST: &str = r#"[^"\\\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]"#;
/// Any later character of a subtask.
const SUBTASK_REST: &str = r#"[^"\\\n\r]"#;

impl PlanGrammar {
    /// The plan lengths allowed, shortest first.
    fn step_counts(&self) -> std::ops::RangeInclusive<usize> {
        (if self.allow_stop { 0 } else { 1 })..=self.max_steps
    }

    /// How many steps the longest plan has: access rules are needed for each of them.
    fn longest(&self) -> usize {
        self.step_counts().max().unwrap_or(0)
    }

    /// Characters a subtask may have after its first.
    fn rest_chars(&self) -> usize {
        self.max_subtask_chars.saturating_sub(1)
    }

    /// The most tokens a plan under this grammar can take, its end token included: the bytes of
    /// the longest text it admits (a character is at most four bytes, and every token the
    /// grammar lets through is at least one byte), plus one. A plan never needs more, so this
    /// cap never cuts one short; it only bounds a generation that would not end.
    pub fn max_tokens(&self) -> usize {
        let n = self.longest();
        let id_bytes = self.model_ids.iter().map(|i| i.to_string().len()).max().unwrap_or(1);
        let digits = |i: usize| i.to_string().len();
        let access: usize = (0..n)
            .map(|i| {
                let fixed = NO_ACCESS.len().max(ALL.len());
                // `[0, 1, …, i-1]`: every earlier step, once each.
                let listed = 2 + (0..i).map(digits).sum::<usize>() + SEP.len() * i.saturating_sub(1);
                if i == 0 { fixed } else { fixed.max(listed) }
            })
            .sum();
        let seps = 3 * SEP.len() * n.saturating_sub(1);
        4 * self.max_reasoning_chars
            + FENCE_OPEN.len()
            + MODEL_ID.len()
            + SUBTASKS.len()
            + ACCESS.len()
            + CLOSE.len()
            + FENCE_CLOSE.len()
            + n * (id_bytes + 2 + 4 * self.max_subtask_chars)
            + access
            + seps
            + 1
    }

    /// Lark in llguidance's dialect, for the local conductor.
    pub fn to_lark(&self) -> String {
        let reasoning = format!("/[^`]{{0,{}}}/", self.max_reasoning_chars);
        let subtask = format!("/\"{SUBTASK_FIRST}{SUBTASK_REST}{{0,{}}}\"/", self.rest_chars());
        self.to_bnf(&LARK, &reasoning, &subtask)
    }

    /// GBNF for llama.cpp's server (`"grammar"` in the request).
    pub fn to_gbnf(&self) -> String {
        let reasoning = format!("[^`]{{0,{}}}", self.max_reasoning_chars);
        let subtask = format!("\"\\\"\" {SUBTASK_FIRST} {SUBTASK_REST}{{0,{}}} \"\\\"\"", self.rest_chars());
        self.to_bnf(&GBNF, &reasoning, &subtask)
    }

    /// The rules, in the spelling of `syntax`; `reasoning` and `subtask` are the bodies of the
    /// two rules whose notation differs most between the dialects.
    fn to_bnf(&self, syntax: &Syntax, reasoning: &str, subtask: &str) -> String {
        let Syntax { start, define, sep, reasoning: reasoning_rule, subtask: subtask_rule } = *syntax;
        let mut g = String::new();
        let mut rule = |name: &str, body: &str| {
            let _ = writeln!(g, "{name}{define} {body}");
        };
        rule(start, &format!("{reasoning_rule} {} plan {}", quote(FENCE_OPEN), quote(FENCE_CLOSE)));
        rule(reasoning_rule, reasoning);
        let plans: Vec<String> = self.step_counts().map(|n| format!("plan{sep}{n}")).collect();
        rule("plan", &plans.join(" | "));
        for n in self.step_counts() {
            let pieces = plan_pieces(n, "id", subtask_rule, |i| format!("access{sep}{i}"));
            let line: Vec<String> = pieces
                .into_iter()
                .map(|p| match p {
                    Piece::Lit(s) => quote(&s),
                    Piece::Ref(r) => r,
                })
                .collect();
            rule(&format!("plan{sep}{n}"), &line.join(" "));
        }
        let ids: Vec<String> = self.model_ids.iter().map(|i| quote(&i.to_string())).collect();
        rule("id", &ids.join(" | "));
        rule(subtask_rule, subtask);
        for i in 0..self.longest() {
            let fixed = format!("{} | {}", quote(NO_ACCESS), quote(ALL));
            if i == 0 {
                rule(&format!("access{sep}0"), &fixed);
                continue;
            }
            let earlier: Vec<String> = (0..i).map(|j| quote(&j.to_string())).collect();
            rule(&format!("earlier{sep}{i}"), &earlier.join(" | "));
            // llguidance rejects a {0,0} repetition, so step 1's list is written out.
            let more = if i > 1 { format!(" ({} earlier{sep}{i}){{0,{}}}", quote(SEP), i - 1) } else { String::new() };
            rule(&format!("access{sep}{i}"), &format!("{fixed} | \"[\" earlier{sep}{i}{more} \"]\""));
        }
        g
    }

    /// One regular expression matching a whole answer (servers match it in full, so it has no
    /// anchors), for vLLM's and SGLang's structured outputs. Uses only syntax that Python's
    /// `re`, Rust's `regex` and the servers' regex-to-automaton compilers share.
    pub fn to_regex(&self) -> String {
        let id = group(self.model_ids.iter().map(|i| i.to_string()));
        let subtask = format!("\"{SUBTASK_FIRST}{SUBTASK_REST}{{0,{}}}\"", self.rest_chars());
        let fixed = [regex_escape(NO_ACCESS), regex_escape(ALL)];
        let access: Vec<String> = (0..self.longest())
            .map(|i| {
                if i == 0 {
                    return group(fixed.iter().cloned());
                }
                let earlier = group((0..i).map(|j| j.to_string()));
                let more =
                    if i > 1 { format!("(?:{}{earlier}){{0,{}}}", regex_escape(SEP), i - 1) } else { String::new() };
                group(fixed.iter().cloned().chain([format!("\\[{earlier}{more}\\]")]))
            })
            .collect();
        let plans = self.step_counts().map(|n| {
            plan_pieces(n, &id, &subtask, |i| access[i].clone())
                .into_iter()
                .map(|p| match p {
                    Piece::Lit(s) => regex_escape(&s),
                    Piece::Ref(r) => r,
                })
                .collect::<String>()
        });
        format!(
            "[^`]{{0,{}}}{}{}{}",
            self.max_reasoning_chars,
            regex_escape(FENCE_OPEN),
            group(plans),
            regex_escape(FENCE_CLOSE)
        )
    }
}

/// How Lark and GBNF spell the same rules.
struct Syntax {
    start: &'static str,
    define: &'static str,
    /// Joins a rule's name and number: Lark allows `_`, GBNF only letters, digits and `-`.
    sep: &'static str,
    reasoning: &'static str,
    subtask: &'static str,
}

/// llguidance reads upper-case rules as terminals (lexemes): the reasoning and a subtask are one
/// regular expression each, as they were written.
const LARK: Syntax = Syntax { start: "start", define: ":", sep: "_", reasoning: "REASONING", subtask: "SUBTASK" };
const GBNF: Syntax = Syntax { start: "root", define: " ::=", sep: "-", reasoning: "reasoning", subtask: "subtask" };

/// A piece of one plan alternative: fixed text, or a reference to a rule or sub-expression.
enum Piece {
    Lit(String),
    Ref(String),
}

/// The sequence of an `n`-step plan, shared by all three dialects:
/// `model_id = [ID, …]\nsubtasks = [S, …]\naccess_list = [A0, …]`.
fn plan_pieces(n: usize, id: &str, subtask: &str, access: impl Fn(usize) -> String) -> Vec<Piece> {
    let mut pieces = vec![Piece::Lit(MODEL_ID.into())];
    let list = |pieces: &mut Vec<Piece>, item: &dyn Fn(usize) -> String| {
        for i in 0..n {
            if i > 0 {
                pieces.push(Piece::Lit(SEP.into()));
            }
            pieces.push(Piece::Ref(item(i)));
        }
    };
    list(&mut pieces, &|_| id.to_owned());
    pieces.push(Piece::Lit(SUBTASKS.into()));
    list(&mut pieces, &|_| subtask.to_owned());
    pieces.push(Piece::Lit(ACCESS.into()));
    list(&mut pieces, &access);
    pieces.push(Piece::Lit(CLOSE.into()));
    // Adjacent literals read better merged: `"]\nsubtasks = ["` rather than two strings.
    let mut merged: Vec<Piece> = Vec::with_capacity(pieces.len());
    for p in pieces {
        match (merged.last_mut(), p) {
            (Some(Piece::Lit(prev)), Piece::Lit(s)) => prev.push_str(&s),
            (_, p) => merged.push(p),
        }
    }
    merged
}

fn group(alternatives: impl IntoIterator<Item = String>) -> String {
    format!("(?:{})", alternatives.into_iter().collect::<Vec<_>>().join("|"))
}

/// A double-quoted string literal as Lark and GBNF both write it.
fn quote(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn regex_escape(s: &str) -> String {
    let mut out = String::new();
    for c in s.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\\' | '.' | '+' | '*' | '?' | '(' | ')' | '|' | '[' | ']' | '{' | '}' | '^' | '$' => {
                out.push('\\');
                out.push(c);
            }
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grammar(ids: &[usize], max_steps: usize, allow_stop: bool) -> PlanGrammar {
        PlanGrammar { model_ids: ids.to_vec(), max_steps, allow_stop, max_reasoning_chars: 100, max_subtask_chars: 50 }
    }

    #[test]
    fn lark_names_every_allowed_piece() {
        let g = grammar(&[0, 1, 2], 3, false).to_lark();
        assert!(g.contains("plan: plan_1 | plan_2 | plan_3\n"), "{g}");
        assert!(g.contains("id: \"0\" | \"1\" | \"2\"\n"), "{g}");
        assert!(g.contains("earlier_2: \"0\" | \"1\"\n"), "{g}");
        assert!(g.contains("REASONING: /[^`]{0,100}/"), "{g}");
        assert!(
            g.contains(
                "plan_1: \"model_id = [\" id \"]\\nsubtasks = [\" SUBTASK \"]\\naccess_list = [\" access_0 \"]\"\n"
            ),
            "{g}"
        );
        assert!(!g.contains("plan_0"), "no stop outside recursion");
        assert!(grammar(&[0], 1, true).to_lark().contains("plan: plan_0 | plan_1"));
    }

    #[test]
    fn the_token_cap_is_the_longest_plan_in_bytes_plus_its_end_token() {
        let g = PlanGrammar {
            model_ids: vec![0, 1, 12],
            max_steps: 3,
            allow_stop: false,
            max_reasoning_chars: 7,
            max_subtask_chars: 5,
        };
        // The longest plan the grammar admits: 7 four-byte characters of reasoning, three steps
        // of the widest id and five four-byte characters each, the longest access lists.
        let s = "\u{10000}".repeat(5);
        let longest = format!(
            "{}\n```python\nmodel_id = [12, 12, 12]\nsubtasks = [\"{s}\", \"{s}\", \"{s}\"]\naccess_list = [\"all\", \"all\", [0, 1]]\n```",
            "\u{10000}".repeat(7)
        );
        let limits = baton_plan::Limits { max_steps: 3, pool_size: Some(13), allow_stop: false };
        baton_plan::parse(&longest, &limits).expect("the longest plan is a plan");
        assert!(regex::Regex::new(&format!("^{}$", g.to_regex())).expect("regex").is_match(&longest));
        assert_eq!(g.max_tokens(), longest.len() + 1);
    }

    #[test]
    fn gbnf_mirrors_the_lark_rules() {
        let g = grammar(&[0, 3], 3, true).to_gbnf();
        assert!(g.starts_with("root ::= reasoning \"\\n```python\\n\" plan \"\\n```\"\n"), "{g}");
        assert!(g.contains("plan ::= plan-0 | plan-1 | plan-2 | plan-3\n"), "{g}");
        assert!(g.contains("plan-0 ::= \"model_id = []\\nsubtasks = []\\naccess_list = []\"\n"), "{g}");
        assert!(g.contains("id ::= \"0\" | \"3\"\n"), "{g}");
        assert!(g.contains(&format!("subtask ::= \"\\\"\" {SUBTASK_FIRST} {SUBTASK_REST}{{0,49}} \"\\\"\"\n")), "{g}");
        assert!(
            g.contains("access-2 ::= \"[]\" | \"\\\"all\\\"\" | \"[\" earlier-2 (\", \" earlier-2){0,1} \"]\"\n"),
            "{g}"
        );
        // GBNF rule names allow letters, digits and dashes only.
        for line in g.lines() {
            let name = line.split(" ::= ").next().unwrap();
            assert!(name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'), "{name}");
        }
    }
}
