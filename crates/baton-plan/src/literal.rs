//! A parser for the subset of Python literal syntax that conductor plans use: integers, strings
//! in every quoting style, lists and tuples, with comments and free whitespace in between.
//!
//! It is deliberately a parser for *literals* only (like Python's `ast.literal_eval`): anything
//! else is a syntax error with a position, never a panic.

use crate::Pos;

/// Deeper nesting than this is rejected instead of recursing without bound on hostile input.
const MAX_DEPTH: usize = 32;

/// A literal value together with where it starts in the source text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Spanned {
    pub(crate) value: Literal,
    /// Byte offset of the first character of the literal.
    pub(crate) start: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Literal {
    Int(i64),
    Str(String),
    /// A list or a tuple: plans do not care which.
    Seq(Vec<Spanned>),
    /// A bare name (`True`, `None`, `x`): kept so the error can say what was found.
    Name(String),
}

impl Literal {
    /// What the value is, in the words an error message uses.
    pub(crate) fn describe(&self) -> String {
        match self {
            Literal::Int(n) => format!("the number {n}"),
            Literal::Str(s) => {
                let short: String = s.chars().take(24).collect();
                if short.len() < s.len() {
                    format!("the string \"{short}…\"")
                } else {
                    format!("the string \"{short}\"")
                }
            }
            Literal::Seq(_) => "a list".to_owned(),
            Literal::Name(n) => format!("the name `{n}`"),
        }
    }
}

/// A syntax error at a byte offset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SyntaxError {
    pub(crate) at: usize,
    pub(crate) message: String,
}

/// Parses one literal starting at byte offset `start` of `src` (leading whitespace and comments
/// are skipped). Returns the literal and the byte offset just past it.
pub(crate) fn parse_literal(src: &str, start: usize) -> Result<(Spanned, usize), SyntaxError> {
    let mut p = Parser { src, at: start };
    let value = p.value(0)?;
    Ok((value, p.at))
}

struct Parser<'a> {
    src: &'a str,
    at: usize,
}

impl Parser<'_> {
    fn rest(&self) -> &str {
        &self.src[self.at..]
    }

    fn peek(&self) -> Option<char> {
        self.rest().chars().next()
    }

    fn peek2(&self) -> Option<char> {
        self.rest().chars().nth(1)
    }

    fn bump(&mut self) -> Option<char> {
        let c = self.peek()?;
        self.at += c.len_utf8();
        Some(c)
    }

    fn error<T>(&self, at: usize, message: impl Into<String>) -> Result<T, SyntaxError> {
        Err(SyntaxError { at, message: message.into() })
    }

    /// Skips whitespace (newlines included: inside brackets Python ignores them), `#` comments
    /// and backslash line continuations.
    fn skip_trivia(&mut self) {
        loop {
            match self.peek() {
                Some(c) if c.is_whitespace() => {
                    self.bump();
                }
                Some('#') => {
                    while let Some(c) = self.peek() {
                        if c == '\n' {
                            break;
                        }
                        self.bump();
                    }
                }
                Some('\\') if matches!(self.peek2(), Some('\n' | '\r')) => {
                    self.bump();
                }
                _ => return,
            }
        }
    }

    fn value(&mut self, depth: usize) -> Result<Spanned, SyntaxError> {
        self.skip_trivia();
        let start = self.at;
        let Some(c) = self.peek() else {
            return self.error(start, "expected a value, found the end of the text");
        };
        let value = match c {
            '[' | '(' => {
                if depth >= MAX_DEPTH {
                    return self.error(start, format!("lists nested deeper than {MAX_DEPTH} levels"));
                }
                self.seq(depth)?
            }
            '0'..='9' => self.int(false)?,
            '-' | '+' => {
                let negative = c == '-';
                self.bump();
                self.skip_trivia();
                match self.peek() {
                    Some('0'..='9') => self.int(negative)?,
                    _ => return self.error(start, format!("expected a number after `{c}`")),
                }
            }
            '"' | '\'' => self.strings()?,
            c if is_ident_start(c) => {
                let name = self.ident();
                // String prefixes (r"...", u'...') look like names until the quote.
                if matches!(self.peek(), Some('"' | '\'')) {
                    let lower = name.to_ascii_lowercase();
                    match lower.as_str() {
                        "r" | "u" => {
                            self.at = start;
                            self.strings()?
                        }
                        "b" | "br" | "rb" => {
                            return self.error(start, "bytes literals are not allowed here; use a plain string");
                        }
                        "f" | "fr" | "rf" => {
                            return self.error(start, "f-strings are not allowed in a plan; write the text out");
                        }
                        _ => Literal::Name(name),
                    }
                } else {
                    Literal::Name(name)
                }
            }
            other => {
                return self.error(start, format!("unexpected character `{}`", other.escape_debug()));
            }
        };
        Ok(Spanned { value, start })
    }

    fn ident(&mut self) -> String {
        let start = self.at;
        while matches!(self.peek(), Some(c) if is_ident_continue(c)) {
            self.bump();
        }
        self.src[start..self.at].to_owned()
    }

    fn seq(&mut self, depth: usize) -> Result<Literal, SyntaxError> {
        let open_at = self.at;
        let open = self.bump();
        let close = if open == Some('[') { ']' } else { ')' };
        let mut items = Vec::new();
        let mut saw_comma = false;
        loop {
            self.skip_trivia();
            match self.peek() {
                Some(c) if c == close => {
                    self.bump();
                    // `(x)` is x in parentheses, not a tuple: only `(x,)` is.
                    if close == ')' && items.len() == 1 && !saw_comma {
                        return Ok(items.pop().map_or(Literal::Seq(Vec::new()), |s: Spanned| s.value));
                    }
                    return Ok(Literal::Seq(items));
                }
                None => {
                    return self.error(open_at, format!("this list is never closed (missing `{close}`)"));
                }
                _ => {}
            }
            items.push(self.value(depth + 1)?);
            self.skip_trivia();
            match self.peek() {
                Some(',') => {
                    saw_comma = true;
                    self.bump();
                }
                Some(c) if c == close => {}
                None => {
                    return self.error(open_at, format!("this list is never closed (missing `{close}`)"));
                }
                Some(c) => {
                    return self.error(
                        self.at,
                        format!("expected `,` or `{close}` between list items, found `{}`", c.escape_debug()),
                    );
                }
            }
        }
    }

    fn int(&mut self, negative: bool) -> Result<Literal, SyntaxError> {
        let start = self.at;
        let mut digits = String::new();
        while let Some(c) = self.peek() {
            match c {
                '0'..='9' => digits.push(c),
                '_' => {}
                _ => break,
            }
            self.bump();
        }
        if matches!(self.peek(), Some('.' | 'e' | 'E' | 'x' | 'X' | 'j')) {
            return self.error(start, "only whole decimal numbers are allowed here");
        }
        if matches!(self.peek(), Some(c) if is_ident_continue(c)) {
            return self.error(self.at, "a number runs straight into a name");
        }
        let magnitude: i64 = match digits.parse() {
            Ok(n) => n,
            Err(_) => return self.error(start, "number too large"),
        };
        Ok(Literal::Int(if negative { -magnitude } else { magnitude }))
    }

    /// One or more adjacent string literals, concatenated as Python does (`"a" 'b'` is `"ab"`).
    fn strings(&mut self) -> Result<Literal, SyntaxError> {
        let mut out = self.string()?;
        loop {
            let save = self.at;
            self.skip_trivia();
            let next_is_string = match self.peek() {
                Some('"' | '\'') => true,
                Some('r' | 'R' | 'u' | 'U') => matches!(self.peek2(), Some('"' | '\'')),
                _ => false,
            };
            if next_is_string {
                out.push_str(&self.string()?);
            } else {
                self.at = save;
                break;
            }
        }
        Ok(Literal::Str(out))
    }

    /// A single string literal, with an optional `r`/`u` prefix.
    fn string(&mut self) -> Result<String, SyntaxError> {
        let start = self.at;
        let mut raw = false;
        if let Some(p @ ('r' | 'R' | 'u' | 'U')) = self.peek() {
            raw = matches!(p, 'r' | 'R');
            self.bump();
        }
        let Some(quote) = self.bump() else {
            return self.error(start, "expected a string");
        };
        let triple = self.peek() == Some(quote) && self.peek2() == Some(quote);
        if triple {
            self.bump();
            self.bump();
        }
        let mut out = String::new();
        loop {
            let here = self.at;
            let Some(c) = self.bump() else {
                return self.error(start, "this string is never closed");
            };
            match c {
                c if c == quote => {
                    if !triple {
                        return Ok(out);
                    }
                    if self.peek() == Some(quote) && self.peek2() == Some(quote) {
                        self.bump();
                        self.bump();
                        return Ok(out);
                    }
                    out.push(c);
                }
                // Python reads source line endings as \n, so CRLF files give the same strings.
                '\r' if triple => {
                    if self.peek() == Some('\n') {
                        self.bump();
                    }
                    out.push('\n');
                }
                '\n' | '\r' if !triple => {
                    return self.error(
                        start,
                        "this string is never closed on its line (use triple quotes or \\n for line breaks)",
                    );
                }
                '\\' => {
                    if raw {
                        // In raw strings a backslash still keeps the next quote from ending the
                        // string, but both characters stay in the value.
                        out.push('\\');
                        if let Some(next) = self.bump() {
                            out.push(next);
                        }
                    } else {
                        self.escape(here, &mut out)?;
                    }
                }
                c => out.push(c),
            }
        }
    }

    /// Decodes the escape after a backslash at `at` into `out`.
    fn escape(&mut self, at: usize, out: &mut String) -> Result<(), SyntaxError> {
        let Some(c) = self.bump() else {
            return self.error(at, "a backslash at the very end of the text");
        };
        match c {
            '\n' => {}
            '\r' => {
                if self.peek() == Some('\n') {
                    self.bump();
                }
            }
            '\\' => out.push('\\'),
            '\'' => out.push('\''),
            '"' => out.push('"'),
            'n' => out.push('\n'),
            't' => out.push('\t'),
            'r' => out.push('\r'),
            'a' => out.push('\u{7}'),
            'b' => out.push('\u{8}'),
            'f' => out.push('\u{c}'),
            'v' => out.push('\u{b}'),
            '0'..='7' => {
                let mut value = c.to_digit(8).unwrap_or(0);
                for _ in 0..2 {
                    match self.peek().and_then(|d| d.to_digit(8)) {
                        Some(d) => {
                            value = value * 8 + d;
                            self.bump();
                        }
                        None => break,
                    }
                }
                out.push(char::from_u32(value).unwrap_or('\u{fffd}'));
            }
            'x' => out.push(self.hex_escape(at, 2)?),
            'u' => out.push(self.hex_escape(at, 4)?),
            'U' => out.push(self.hex_escape(at, 8)?),
            'N' => return self.error(at, "named escapes (\\N{...}) are not supported; write the character itself"),
            // Python keeps unknown escapes as they are, backslash included.
            other => {
                out.push('\\');
                out.push(other);
            }
        }
        Ok(())
    }

    fn hex_escape(&mut self, at: usize, len: usize) -> Result<char, SyntaxError> {
        let mut value: u32 = 0;
        for _ in 0..len {
            match self.peek().and_then(|d| d.to_digit(16)) {
                Some(d) => {
                    value = value * 16 + d;
                    self.bump();
                }
                None => return self.error(at, format!("this escape needs {len} hex digits")),
            }
        }
        match char::from_u32(value) {
            Some(ch) => Ok(ch),
            None => self.error(at, format!("\\u{value:x} is not a valid character")),
        }
    }
}

pub(crate) fn is_ident_start(c: char) -> bool {
    c == '_' || c.is_alphabetic()
}

pub(crate) fn is_ident_continue(c: char) -> bool {
    c == '_' || c.is_alphanumeric()
}

/// Converts a byte offset into a 1-based line and column (columns count characters).
pub(crate) fn pos_at(src: &str, offset: usize) -> Pos {
    let offset = offset.min(src.len());
    let before = &src[..offset];
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let column = before[line_start..].chars().count() + 1;
    Pos { line, column }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lit(src: &str) -> Literal {
        parse_literal(src, 0).expect("parses").0.value
    }

    fn err(src: &str) -> String {
        parse_literal(src, 0).expect_err("fails").message
    }

    fn s(x: &str) -> Literal {
        Literal::Str(x.to_owned())
    }

    fn items(l: Literal) -> Vec<Literal> {
        match l {
            Literal::Seq(v) => v.into_iter().map(|s| s.value).collect(),
            other => panic!("not a list: {other:?}"),
        }
    }

    #[test]
    fn quoting_styles_and_escapes() {
        assert_eq!(lit(r#""a\nb""#), s("a\nb"));
        assert_eq!(lit(r"'it\'s'"), s("it's"));
        assert_eq!(lit(r#""say \"hi\"""#), s("say \"hi\""));
        assert_eq!(lit(r#""back\\slash""#), s("back\\slash"));
        assert_eq!(lit(r#""\u00e9t\u00E9""#), s("été"));
        assert_eq!(lit(r#""\U0001F600""#), s("😀"));
        assert_eq!(lit(r#""\x41\101""#), s("AA"));
        assert_eq!(lit(r#""keep \d""#), s("keep \\d"));
        assert_eq!(lit("\"\"\"multi\nline with \"quotes\" \"\"\""), s("multi\nline with \"quotes\" "));
        assert_eq!(lit("'''it's'''"), s("it's"));
        assert_eq!(lit(r#"r"\n raw""#), s("\\n raw"));
        assert_eq!(lit(r#""con" 'cat' """enated""""#), s("concatenated"));
        assert_eq!(lit("\"line\\\ncontinued\""), s("linecontinued"));
    }

    #[test]
    fn nested_lists_comments_trailing_commas() {
        let l = lit("[ [], # nothing\n  'all',\n  [0, 1,],\n  (2,),\n]");
        let v = items(l);
        assert_eq!(v.len(), 4);
        assert_eq!(v[0], Literal::Seq(vec![]));
        assert_eq!(v[1], s("all"));
        assert_eq!(items(v[2].clone()), vec![Literal::Int(0), Literal::Int(1)]);
        assert_eq!(items(v[3].clone()), vec![Literal::Int(2)]);
        assert_eq!(lit("-3"), Literal::Int(-3));
        assert_eq!(lit("(\"wrapped \"\n \"string\")"), s("wrapped string"), "parentheses group; they make no tuple");
        assert_eq!(lit("(2)"), Literal::Int(2));
        assert_eq!(items(lit("(2,)")), vec![Literal::Int(2)]);
        assert_eq!(lit("()"), Literal::Seq(vec![]));
        assert_eq!(lit("'''a\r\nb\rc'''"), s("a\nb\nc"));
        assert_eq!(lit("1_000"), Literal::Int(1000));
    }

    #[test]
    fn errors_are_positioned_not_panics() {
        assert!(err("[1, 2").contains("never closed"));
        assert!(err("'abc").contains("never closed"));
        assert!(err("'abc\n'").contains("on its line"));
        assert!(err("[1 2]").contains("expected `,`"));
        assert!(err("1.5").contains("whole"));
        assert!(err(r#""\u12""#).contains("4 hex digits"));
        assert!(err("f'x'").contains("f-strings"));
        assert!(err(&"[".repeat(100)).contains("nested deeper"));
        assert!(err("99999999999999999999999").contains("too large"));
        let e = parse_literal("[1,\n  @]", 0).expect_err("fails");
        assert_eq!(pos_at("[1,\n  @]", e.at), Pos { line: 2, column: 3 });
    }
}
