//! Reading the answer out of a model's text, the documented way, and comparing it with the
//! reference. No model is asked to grade: every rule here is deterministic.
//!
//! - `number`: the last `#### N`, else the last `\boxed{…}`, else the last number in the text.
//!   Numbers compare as numbers: `1,234`, `$5`, `12 cm`, `3.0`, `\frac{3}{4}`, `3/4` and `0.75`
//!   are what they look like.
//! - `choice`: the letter after the last `Answer:` (or "the answer is"), else the last
//!   standalone option letter (A–D for four options).
//! - `exact`: the last `\boxed{…}`, else the last non-empty line; compared after lower-casing and
//!   dropping spaces, `$`, `\left`/`\right` and a final full stop.
//! - `code`: the last fenced code block (```` ```python ````), else the whole text.

/// A number as the rules above read it.
pub fn parse_number(text: &str) -> Option<f64> {
    let mut s = text.trim().to_owned();
    for (from, to) in [("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\!", ""), ("\\,", ""), ("\\$", "")] {
        s = s.replace(from, to);
    }
    let s = strip_text_macros(&s);
    let s: String = s.chars().filter(|c| !matches!(c, '$' | ',' | ' ')).collect();
    if let Some(rest) = s.strip_prefix("\\frac").or_else(|| s.strip_prefix("-\\frac")) {
        let negative = s.starts_with('-');
        let (a, b) = braced_pair(rest)?;
        let v = parse_plain(&a)? / parse_plain(&b)?;
        return Some(if negative { -v } else { v });
    }
    let s: String = s.chars().filter(|c| *c != '{' && *c != '}').collect();
    if let Some((a, b)) = s.split_once('/') {
        return Some(parse_plain(a)? / parse_plain(b)?);
    }
    parse_plain(&s)
}

/// `\text{cm}` and the like are units or words: drop them.
fn strip_text_macros(s: &str) -> String {
    let mut out = s.to_owned();
    for mac in ["\\text{", "\\mbox{", "\\mathrm{"] {
        while let Some(at) = out.find(mac) {
            let end = out[at..].find('}').map_or(out.len(), |e| at + e + 1);
            out.replace_range(at..end, "");
        }
    }
    out.replace("^\\circ", "").replace("^{\\circ}", "").replace("\\%", "").replace('%', "")
}

/// `{a}{b}` → (a, b).
fn braced_pair(s: &str) -> Option<(String, String)> {
    let a = s.strip_prefix('{')?;
    let (a, rest) = a.split_once('}')?;
    let b = rest.strip_prefix('{')?;
    let (b, _) = b.split_once('}')?;
    Some((a.to_owned(), b.to_owned()))
}

/// A decimal number, possibly with a unit or words after it (`12cm`, `5dollars`).
fn parse_plain(s: &str) -> Option<f64> {
    let s = s.trim();
    let end = s
        .char_indices()
        .find(|&(i, c)| !(c.is_ascii_digit() || c == '.' || ((c == '-' || c == '+') && i == 0)))
        .map_or(s.len(), |(i, _)| i);
    let number = s[..end].trim_end_matches('.');
    if number.is_empty() || number == "-" || number == "+" {
        return None;
    }
    // A number followed by more mathematics (`2\sqrt{3}`, `2^{10}`, `3(4)`, `1e-3`, `1.2.3`) is
    // not that number; a unit or a word after it (`12cm`) is fine.
    let rest = &s[end..];
    let mut after = rest.chars();
    let next = after.next();
    let then = after.next();
    let more_maths = match next {
        Some('\\' | '^' | '*' | '(' | '!') => true,
        Some('e' | 'E') => then.is_some_and(|c| c.is_ascii_digit() || c == '-' || c == '+'),
        Some('.') => then.is_some_and(|c| c.is_ascii_digit()),
        _ => false,
    };
    if more_maths {
        return None;
    }
    number.parse().ok()
}

/// Whether two numbers are the same answer (relative tolerance 1e-6, absolute near zero).
pub fn same_number(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-6 * a.abs().max(b.abs()).max(1.0)
}

/// The contents of the last `\boxed{…}`, braces balanced.
pub fn last_boxed(text: &str) -> Option<String> {
    let at = text.rfind("\\boxed{")?;
    let body = &text[at + "\\boxed{".len()..];
    let mut depth = 1;
    for (i, c) in body.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(body[..i].trim().to_owned());
                }
            }
            _ => {}
        }
    }
    None
}

/// The text of the number answer: `#### N`, else `\boxed{}`, else the last number.
pub fn extract_number(text: &str) -> Option<String> {
    if let Some((_, after)) = text.rsplit_once("####") {
        let line = after.trim().lines().next().unwrap_or_default().trim();
        if !line.is_empty() {
            return Some(line.to_owned());
        }
    }
    if let Some(boxed) = last_boxed(text) {
        return Some(boxed);
    }
    last_number(text)
}

/// The last number written in the text (`-1,234.5`, `3/4`), as written.
fn last_number(text: &str) -> Option<String> {
    let chars: Vec<char> = text.chars().collect();
    let mut i = chars.len();
    while i > 0 {
        i -= 1;
        if !chars[i].is_ascii_digit() {
            continue;
        }
        let end = i + 1;
        let mut start = i;
        while start > 0 {
            let c = chars[start - 1];
            let digit_before = start >= 2 && chars[start - 2].is_ascii_digit();
            if c.is_ascii_digit() || (matches!(c, '.' | ',' | '/') && digit_before) {
                start -= 1;
            } else {
                break;
            }
        }
        if start > 0 && chars[start - 1] == '-' {
            start -= 1;
        }
        return Some(chars[start..end].iter().collect());
    }
    None
}

/// The option letter a text answers with, for `options` options.
pub fn extract_choice(text: &str, options: usize) -> Option<char> {
    let last = (b'A' + options.clamp(1, 26) as u8 - 1) as char;
    let is_option = |c: char| c.is_ascii_uppercase() && c <= last;
    // ASCII lower-casing keeps byte positions, so they index `text` too.
    let lower = text.to_ascii_lowercase();
    let mut best: Option<(usize, char)> = None;
    for marker in ["answer:", "answer is", "answer is:"] {
        if let Some(at) = lower.rfind(marker) {
            let after = &text[at + marker.len()..];
            let letter = after
                .trim_start_matches(|c: char| c.is_whitespace() || matches!(c, '(' | '*' | '[' | ':'))
                .chars()
                .next();
            if let Some(l) = letter.map(|c| c.to_ascii_uppercase()).filter(|c| is_option(*c))
                && best.is_none_or(|(b, _)| at > b)
            {
                best = Some((at, l));
            }
        }
    }
    if let Some((_, l)) = best {
        return Some(l);
    }
    let chars: Vec<char> = text.chars().collect();
    (0..chars.len()).rev().find_map(|i| {
        let c = chars[i];
        let alone_before = i == 0 || !chars[i - 1].is_alphanumeric();
        let alone_after = i + 1 == chars.len() || !chars[i + 1].is_alphanumeric();
        (is_option(c) && alone_before && alone_after).then_some(c)
    })
}

/// A string answer as compared: the last `\boxed{}`, else the last non-empty line.
pub fn extract_exact(text: &str) -> Option<String> {
    last_boxed(text).or_else(|| text.lines().rev().map(str::trim).find(|l| !l.is_empty()).map(str::to_owned))
}

/// The form two exact answers are compared in.
pub fn normalize_exact(s: &str) -> String {
    let s = s.replace("\\left", "").replace("\\right", "").replace("\\dfrac", "\\frac");
    let s = s.trim().trim_end_matches('.');
    s.chars().filter(|c| !c.is_whitespace() && *c != '$').flat_map(char::to_lowercase).collect()
}

/// The code in a model's answer: the last fenced block, else all of it.
pub fn extract_code(text: &str) -> String {
    let mut blocks = Vec::new();
    let mut rest = text;
    while let Some(open) = rest.find("```") {
        let after = &rest[open + 3..];
        let body_start = after.find('\n').map_or(after.len(), |n| n + 1);
        let body = &after[body_start..];
        let Some(close) = body.find("```") else {
            blocks.push(body.to_owned());
            break;
        };
        blocks.push(body[..close].to_owned());
        rest = &body[close + 3..];
    }
    blocks.pop().unwrap_or_else(|| text.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_read_the_documented_way() {
        let cases = [
            ("So she makes 9 * 2 = 18 dollars.\n#### 18", Some("18")),
            ("The answer is $\\boxed{\\frac{3}{4}}$, not 7.", Some("\\frac{3}{4}")),
            ("First 12, then 1,234.5 cm", Some("1,234.5")),
            ("It drops to -7 degrees", Some("-7")),
            ("a ratio of 3/4", Some("3/4")),
            ("#### 42\nExplanation: 40 + 2", Some("42")),
            ("no number at all", None),
        ];
        for (text, want) in cases {
            assert_eq!(extract_number(text).as_deref(), want, "{text}");
        }
    }

    #[test]
    fn numbers_compare_as_numbers() {
        let same = [
            ("1,234", "1234"),
            ("$18", "18"),
            ("18.00", "18"),
            ("\\frac{3}{4}", "0.75"),
            ("\\dfrac{3}{4}", "3/4"),
            ("-\\frac{1}{2}", "-0.5"),
            ("12 cm", "12"),
            ("12\\text{ cm}", "12"),
            ("90^\\circ", "90"),
            ("25\\%", "25"),
        ];
        for (a, b) in same {
            let (x, y) = (parse_number(a).unwrap(), parse_number(b).unwrap());
            assert!(same_number(x, y), "{a} vs {b}: {x} {y}");
        }
        assert!(!same_number(parse_number("18").unwrap(), parse_number("18.5").unwrap()));
        assert_eq!(parse_number("x"), None);
        for not_a_number in ["2\\sqrt{3}", "2^{10}", "3(4)", "1e-3", "1.2.3", "5!"] {
            assert_eq!(parse_number(not_a_number), None, "{not_a_number}");
        }
        // Non-ASCII text before an answer line must not upset the byte positions.
        assert_eq!(extract_choice("İİİİİİİİ answer: B", 4), Some('B'));
        assert_eq!(parse_number("-"), None);
    }

    #[test]
    fn choices_prefer_the_answer_line_then_the_last_standalone_letter() {
        assert_eq!(extract_choice("A is tempting but wrong.\nAnswer: C", 4), Some('C'));
        assert_eq!(extract_choice("I think the answer is (b).", 4), Some('B'));
        assert_eq!(extract_choice("Between A and D, D fits best", 4), Some('D'));
        // "I" is a word, not an option of four; "E" is not an option either.
        assert_eq!(extract_choice("I have no idea. E", 4), None);
        assert_eq!(extract_choice("Answer: E", 5), Some('E'));
        assert_eq!(extract_choice("**Answer:** B", 4), Some('B'));
    }

    #[test]
    fn exact_answers_and_code_blocks() {
        assert_eq!(extract_exact("Work...\n\nParis.\n").as_deref(), Some("Paris."));
        assert_eq!(normalize_exact("Paris."), normalize_exact(" paris "));
        assert_eq!(normalize_exact("\\left( 3, \\frac{\\pi}{2} \\right)"), "(3,\\frac{\\pi}{2})");
        assert_eq!(extract_code("Here:\n```python\ndef f():\n    return 1\n```\nDone."), "def f():\n    return 1\n");
        assert_eq!(extract_code("```\na\n```\n```py\nb\n```"), "b\n");
        assert_eq!(extract_code("def f(): pass"), "def f(): pass");
        assert_eq!(extract_code("```python\ndef f(): pass"), "def f(): pass");
    }
}
