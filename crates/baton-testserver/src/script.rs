//! What the server does for a call, read from the model name: `NAME;key=value;...`.

use std::time::Duration;

/// Directives, all optional:
///
/// | directive | effect |
/// |---|---|
/// | `reply=TEXT` | answer TEXT (`_` stands for a space) instead of the default echo |
/// | `latency=MS` | spread the answer over MS milliseconds |
/// | `ttfb=MS` | wait MS before sending the response headers |
/// | `slow=MSxN` | like `ttfb` but only for the first N calls |
/// | `fail=STATUSxN` | answer the first N calls with the wire's error body for STATUS (`x*`: always) |
/// | `retry_after=S` | send `Retry-After: S` with 429/503/529 errors |
/// | `cut=N` | cut the stream mid-event on the first N calls |
/// | `garbage=N` | answer the first N calls with a 200 that is not the wire format |
/// | `stream_error=N` | on the first N calls, send some text then an in-stream error event |
/// | `chunks=N` | split the answer into N pieces (default: one per word) |
/// | `usage=max` | report the most tokens an honest provider could: the prompt's bytes plus 3 per turn in, the request's output cap out |
/// | `cache_min=N` | prompt-cache prefixes from N tokens (default 1024, the providers' documented minimum) |
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Script {
    pub name: String,
    pub reply: Option<String>,
    pub latency: Duration,
    pub ttfb: Duration,
    pub slow: Option<(Duration, u32)>,
    pub fail: Option<(u16, u32)>,
    pub retry_after: Option<String>,
    pub cut: u32,
    pub garbage: u32,
    pub stream_error: u32,
    pub chunks: Option<usize>,
    pub usage_max: bool,
    pub cache_min: Option<u64>,
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
                "usage" => script.usage_max = value == "max",
                "cache_min" => script.cache_min = value.parse().ok(),
                _ => {}
            }
        }
        script
    }

    /// The answer text for a conversation whose last user turn is `last_user` and which holds
    /// `seen` earlier answers.
    pub fn answer(&self, last_user: &str, seen: usize) -> String {
        match &self.reply {
            Some(r) => r.clone(),
            None => {
                let gist: String = last_user.chars().take(80).collect();
                format!("{} (saw {seen} earlier answers) answers: {gist}", self.name)
            }
        }
    }

    /// Splits the answer into the pieces that are streamed.
    pub fn pieces(&self, text: &str) -> Vec<String> {
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
}
