//! What the server does for a call, read from the model name: `NAME;key=value;...`.

use std::time::Duration;

/// Directives, all optional:
///
/// | directive | effect |
/// |---|---|
/// | `reply=TEXT` | answer TEXT (`_` stands for a space) instead of the default echo |
/// | `knows=PATH` | a JSON object `{needle: reply}`: answer the reply of the needle found in the last user turn (needles must not overlap; else as without it), so a worker can be right on exactly the questions a test chooses |
/// | `after=PATH` | like `knows=`, but the needle is looked for in the earlier answers the call shows (assistant turns): a worker that answers right only after seeing another worker's answer (it wins over `knows=`) |
/// | `latency=MS` | spread the answer over MS milliseconds |
/// | `ttfb=MS` | wait MS before sending the response headers |
/// | `slow=MSxN` | like `ttfb` but only for the first N calls |
/// | `fail=STATUSxN` | answer the first N calls with the wire's error body for STATUS (`x*`: always) |
/// | `retry_after=S` | send `Retry-After: S` with 429/503/529 errors |
/// | `cut=N` | cut the stream mid-event on the first N calls |
/// | `garbage=N` | answer the first N calls with a 200 that is not the wire format |
/// | `stream_error=N` | on the first N calls, send some text then an in-stream error event |
/// | `chunks=N` | split the answer into N pieces (default: one per word) |
/// | `lines=N` | answer N lines of varied markdown (paragraphs, lists, tables, fenced code with and without a language; each line but blank and fence lines carries `(line I)`, I from 0), one piece per line, so with `latency=MS` one line every MS/N ms |
/// | `usage=max` | report the most tokens an honest provider could: the prompt's bytes plus 3 per turn in, the request's output cap out |
/// | `cache_min=N` | prompt-cache prefixes from N tokens (default 1024, the providers' documented minimum) |
/// | `plan=each` | a conductor that tries every worker: call N answers a one-step plan on worker N mod k, k the workers its prompt lists (`- Model I:`) |
/// | `plan=copy` | a conductor that copies what it is shown: it answers the last example workflow of its prompt as it stands (worker 0 alone when there is none) |
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Script {
    pub name: String,
    pub reply: Option<String>,
    pub knows: Option<std::path::PathBuf>,
    pub after: Option<std::path::PathBuf>,
    pub latency: Duration,
    pub ttfb: Duration,
    pub slow: Option<(Duration, u32)>,
    pub fail: Option<(u16, u32)>,
    pub retry_after: Option<String>,
    pub cut: u32,
    pub garbage: u32,
    pub stream_error: u32,
    pub chunks: Option<usize>,
    pub lines: Option<usize>,
    pub usage_max: bool,
    pub cache_min: Option<u64>,
    pub plan: Option<PlanMode>,
}

/// How a scripted conductor writes its plan (`plan=`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlanMode {
    Each,
    Copy,
}

impl Script {
    /// Unknown or malformed directives are ignored: the server must answer something.
    pub fn parse(model: &str) -> Script {
        let mut parts = model.split(';');
        let mut script = Script { name: parts.next().unwrap_or_default().to_owned(), ..Script::default() };
        for part in parts {
            let Some((key, value)) = part.split_once('=') else { continue };
            let ms = |v: &str| v.parse::<u64>().ok().map(Duration::from_millis);
            let times = |v: &str| -> Option<(String, u32)> {
                match v.split_once('x') {
                    Some((a, "*")) => Some((a.to_owned(), u32::MAX)),
                    Some((a, n)) => n.parse().ok().map(|n| (a.to_owned(), n)),
                    None => Some((v.to_owned(), u32::MAX)),
                }
            };
            match key {
                "reply" => script.reply = Some(value.replace('_', " ")),
                "knows" => script.knows = Some(value.into()),
                "after" => script.after = Some(value.into()),
                "latency" => script.latency = ms(value).unwrap_or_default(),
                "ttfb" => script.ttfb = ms(value).unwrap_or_default(),
                "slow" => {
                    script.slow = times(value).and_then(|(d, n)| ms(&d).map(|d| (d, n)));
                }
                "fail" => script.fail = times(value).and_then(|(s, n)| s.parse().ok().map(|s| (s, n))),
                "retry_after" => script.retry_after = Some(value.to_owned()),
                "cut" => script.cut = value.parse().unwrap_or(0),
                "garbage" => script.garbage = value.parse().unwrap_or(0),
                "stream_error" => script.stream_error = value.parse().unwrap_or(0),
                "chunks" => script.chunks = value.parse().ok().filter(|n| *n > 0),
                "lines" => script.lines = value.parse().ok().filter(|n| *n > 0),
                "usage" => script.usage_max = value == "max",
                "cache_min" => script.cache_min = value.parse().ok(),
                "plan" => {
                    script.plan = match value {
                        "each" => Some(PlanMode::Each),
                        "copy" => Some(PlanMode::Copy),
                        _ => None,
                    }
                }
                _ => {}
            }
        }
        script
    }

    /// The answer text for a conversation whose last user turn is `last_user` and whose earlier
    /// answers (assistant turns) are `earlier`.
    pub fn answer(&self, last_user: &str, earlier: &[&str]) -> String {
        let seen = earlier.len();
        if let Some(known) =
            self.after.as_deref().and_then(|path| earlier.iter().find_map(|answer| known_reply(path, answer)))
        {
            return known;
        }
        if let Some(known) = self.knows.as_deref().and_then(|path| known_reply(path, last_user)) {
            return known;
        }
        match (&self.reply, self.lines) {
            (Some(r), _) => r.clone(),
            (None, Some(n)) => long_markdown(n),
            (None, None) => {
                let gist: String = last_user.chars().take(80).collect();
                format!("{} (saw {seen} earlier answers) answers: {gist}", self.name)
            }
        }
    }

    /// A scripted conductor's plan (`plan=`) for a request whose prompt (system text and user
    /// turns) is `system`, on this model's call number `call`; `None` for a worker.
    pub fn plan(&self, system: &str, call: u32) -> Option<String> {
        let one_step = |worker: usize| {
            format!("```python\nmodel_id = [{worker}]\nsubtasks = [\"Answer the question.\"]\naccess_list = [[]]\n```")
        };
        match self.plan? {
            PlanMode::Each => {
                // The conductor itself, listed last where it may take a step, is not tried.
                let workers = (0..)
                    .take_while(|i| {
                        system.contains(&format!("- Model {i}:")) && !system.contains(&format!("- Model {i}: yourself"))
                    })
                    .count()
                    .max(1);
                Some(one_step(call as usize % workers))
            }
            PlanMode::Copy => {
                // Every workflow shown but the format's template (`model_id = [...]`).
                let shown = system
                    .split("```python\n")
                    .skip(1)
                    .filter_map(|rest| rest.split_once("\n```").map(|(lists, _)| lists))
                    .filter(|lists| !lists.contains("[...]"));
                Some(shown.last().map_or_else(|| one_step(0), |lists| format!("```python\n{lists}\n```")))
            }
        }
    }

    /// Splits the answer into the pieces that are streamed.
    pub fn pieces(&self, text: &str) -> Vec<String> {
        if self.lines.is_some() {
            // One line per piece, its newline included, like a model that streams line by line.
            return text.split_inclusive('\n').map(str::to_owned).collect();
        }
        match self.chunks {
            Some(n) => {
                let chars: Vec<char> = text.chars().collect();
                let size = chars.len().div_ceil(n).max(1);
                chars.chunks(size).map(|c| c.iter().collect()).collect()
            }
            None => {
                let mut out: Vec<String> = Vec::new();
                for (i, word) in text.split(' ').enumerate() {
                    out.push(if i == 0 { word.to_owned() } else { format!(" {word}") });
                }
                out
            }
        }
    }
}

/// The reply of a needle that `last_user` contains.
fn known_reply(path: &std::path::Path, last_user: &str) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    let table: serde_json::Map<String, serde_json::Value> = serde_json::from_str(&text).ok()?;
    table
        .iter()
        .find(|(needle, _)| last_user.contains(needle.as_str()))
        .and_then(|(_, r)| r.as_str().map(str::to_owned))
}

/// `n` lines of the markdown a long answer is made of, in blocks separated by blank lines:
/// paragraphs with inline markup, bullet lists with a nested item, numbered lists, tables, and
/// fenced code with a language and without one (which a renderer must guess). The last block is
/// cut where the `n` lines end, as a stream stopped there would be, and every line ends with a
/// newline. Each line with text carries `(line I)`, its index from 0, so a client can tell how
/// far what it shows has got.
pub fn long_markdown(n: usize) -> String {
    let mut lines: Vec<String> = Vec::with_capacity(n + 8);
    let mut block: usize = 0;
    while lines.len() < n {
        let i = lines.len();
        let at = |k: usize| format!("(line {})", i + k);
        match block % 6 {
            0 => {
                lines.push(format!(
                    "Part {block} {} explains **why step {block} matters** and how `value_{block}` is",
                    at(0)
                ));
                lines.push(format!("computed from the previous part {} with *care*, then checked twice.", at(1)));
                lines.push(format!("The result is kept for the next part {}.", at(2)));
            }
            1 => {
                lines.push(format!("- first point of part {block} {}", at(0)));
                lines.push(format!("- second point, with `inline code` {}", at(1)));
                lines.push(format!("  - a nested detail {}", at(2)));
                lines.push(format!("- third point, **in bold** {}", at(3)));
            }
            2 => {
                lines.push("```python".to_owned());
                lines.push(format!("def part_{block}(values):  # {}", at(1)));
                lines.push(format!("    total = sum(v * {block} for v in values)  # {}", at(2)));
                lines.push(format!("    return {{\"part\": {block}, \"total\": total}}  # {}", at(3)));
                lines.push("```".to_owned());
            }
            3 => {
                lines.push(format!("| part | value | note {} |", at(0)));
                lines.push("|---:|---|---|".to_owned());
                lines.push(format!("| {block} | {} | first row {} |", block * 7, at(2)));
                lines.push(format!("| {} | {} | second row {} |", block + 1, block * 7 + 3, at(3)));
            }
            4 => {
                lines.push("```".to_owned());
                lines
                    .push(format!("let total_{block} = values.iter().map(|v| v * {block}).sum::<i64>(); // {}", at(1)));
                lines.push(format!(
                    "if total_{block} > 100 {{ println!(\"large: {{}}\", total_{block}); }} // {}",
                    at(2)
                ));
                lines.push(format!("SELECT part, value FROM parts WHERE part = {block}; -- {}", at(3)));
                lines.push("```".to_owned());
            }
            _ => {
                lines.push(format!("1. check the input of part {block} {}", at(0)));
                lines.push(format!("2. run the step and compare with part {} {}", block.saturating_sub(1), at(1)));
                lines.push(format!("3. write the result down {}", at(2)));
            }
        }
        lines.push(String::new());
        block += 1;
    }
    lines.truncate(n);
    lines.iter().map(|l| format!("{l}\n")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directives() {
        let s = Script::parse("m;latency=300;fail=429x2;retry_after=1;cut=1;reply=hello_world;slow=900x1");
        assert_eq!(s.name, "m");
        assert_eq!(s.latency, Duration::from_millis(300));
        assert_eq!(s.fail, Some((429, 2)));
        assert_eq!(s.retry_after.as_deref(), Some("1"));
        assert_eq!(s.cut, 1);
        assert_eq!(s.reply.as_deref(), Some("hello world"));
        assert_eq!(s.slow, Some((Duration::from_millis(900), 1)));
        assert_eq!(Script::parse("m;fail=500").fail, Some((500, u32::MAX)));
        assert_eq!(s.pieces("a b c"), vec!["a", " b", " c"]);
    }

    #[test]
    fn lines_streams_a_long_markdown_answer_one_line_per_piece() {
        let s = Script::parse("long;lines=40;latency=2000");
        assert_eq!(s.lines, Some(40));
        let text = s.answer("anything", &[]);
        let pieces = s.pieces(&text);
        assert_eq!(pieces.len(), 40);
        assert_eq!(pieces.concat(), text);
        assert!(pieces.iter().all(|p| p.ends_with('\n') && p.matches('\n').count() == 1));
        // Every line that has text says which line it is.
        for (i, p) in pieces.iter().enumerate() {
            let line = p.trim_end();
            if !(line.is_empty() || line.starts_with("```") || line.starts_with("|---")) {
                assert!(line.contains(&format!("(line {i})")), "line {i}: {line}");
            }
        }
        // The blocks a renderer has to handle are all there.
        for needle in ["**", "\n- ", "\n  - ", "\n1. ", "| part |", "```python\n", "\n```\nlet "] {
            assert!(text.contains(needle), "no {needle:?} in {text}");
        }
        assert_eq!(Script::parse("long;lines=4000").pieces(&long_markdown(4000)).len(), 4000);
        // A scripted reply wins; without `lines` nothing changes.
        assert_eq!(Script::parse("m;lines=5;reply=hi").answer("q", &[]), "hi");
        // Scripted conductors: every worker in turn, or the last example shown.
        let system = "Workers:\n- Model 0: a\n- Model 1: b\n```python\nmodel_id = [...]\n```\nExample [x]. Question: q\n```python\nmodel_id = [0]\nsubtasks = [\"s\"]\naccess_list = [[]]\n```\n\nExample [learned]. Question: r\n```python\nmodel_id = [1]\nsubtasks = [\"t\"]\naccess_list = [[]]\n```\n";
        let each = Script::parse("c;plan=each");
        assert!(each.plan(system, 3).expect("a plan").contains("model_id = [1]"));
        assert!(each.plan(system, 4).expect("a plan").contains("model_id = [0]"));
        let copied = Script::parse("c;plan=copy").plan(system, 0).expect("a plan");
        assert_eq!(copied, "```python\nmodel_id = [1]\nsubtasks = [\"t\"]\naccess_list = [[]]\n```");
        assert_eq!(Script::parse("w").plan(system, 0), None, "a worker writes no plan");
        assert_eq!(Script::parse("m;lines=0").lines, None);
    }

    #[test]
    fn after_answers_only_from_what_an_earlier_answer_says() {
        let path = std::env::temp_dir().join(format!("baton-after-{}.json", std::process::id()));
        std::fs::write(&path, "{\"17 * 23\": \"#### 391\"}").expect("write");
        let s = Script::parse(&format!("calc;after={}", path.display()));
        // The question alone, even with the expression in it, is not enough: it must be an answer seen.
        assert!(s.answer("What is 17 * 23?", &[]).starts_with("calc (saw 0 earlier answers)"));
        assert_eq!(s.answer("Compute it.", &["The question asks for 17 * 23."]), "#### 391");
        assert!(s.answer("Compute it.", &["I do not know."]).starts_with("calc (saw 1 earlier answers)"));
        let _ = std::fs::remove_file(&path);
    }
}
