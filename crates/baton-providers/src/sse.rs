//! A decoder for `text/event-stream` (the WHATWG server-sent events format), fed by arbitrary
//! byte chunks as they arrive from the network.

/// One dispatched event.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SseEvent {
    /// The `event:` field; `None` means the default type ("message").
    pub event: Option<String>,
    /// The `data:` lines joined with `\n`.
    pub data: String,
}

#[derive(Debug, Default)]
pub struct SseDecoder {
    /// Bytes of the line in progress.
    line: Vec<u8>,
    /// The previous chunk ended in `\r`; a leading `\n` in the next one belongs to it.
    pending_cr: bool,
    event: Option<String>,
    data: Option<String>,
    /// How many bytes of a leading byte-order mark were matched (3 once past the start).
    bom: u8,
}

/// The stream is not valid UTF-8.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidUtf8;

impl SseDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds a chunk; returns the events it completes.
    pub fn push(&mut self, chunk: &[u8]) -> Result<Vec<SseEvent>, InvalidUtf8> {
        let mut events = Vec::new();
        for &b in chunk {
            // The standard strips one leading UTF-8 byte-order mark.
            if self.bom < 3 {
                if b == [0xEF, 0xBB, 0xBF][self.bom as usize] {
                    self.bom += 1;
                    continue;
                }
                // Not a mark after all: give back what was held.
                let held = [0xEF, 0xBB, 0xBF][..self.bom as usize].to_vec();
                self.bom = 3;
                self.line.extend(held);
            }
            if self.pending_cr {
                self.pending_cr = false;
                if b == b'\n' {
                    continue;
                }
            }
            match b {
                b'\n' => self.end_line(&mut events)?,
                b'\r' => {
                    self.pending_cr = true;
                    self.end_line(&mut events)?;
                }
                _ => self.line.push(b),
            }
        }
        Ok(events)
    }

    /// Whether bytes of an unfinished event are buffered (a stream that ends here was cut).
    pub fn has_partial_event(&self) -> bool {
        !self.line.is_empty() || self.data.is_some()
    }

    fn end_line(&mut self, events: &mut Vec<SseEvent>) -> Result<(), InvalidUtf8> {
        let line = std::mem::take(&mut self.line);
        let line = String::from_utf8(line).map_err(|_| InvalidUtf8)?;
        if line.is_empty() {
            if let Some(data) = self.data.take() {
                events.push(SseEvent { event: self.event.take(), data });
            }
            self.event = None;
            return Ok(());
        }
        if line.starts_with(':') {
            return Ok(()); // comment, used as keep-alive
        }
        let (field, value) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (line.as_str(), ""),
        };
        match field {
            "event" => self.event = Some(value.to_owned()),
            "data" => match &mut self.data {
                Some(data) => {
                    data.push('\n');
                    data.push_str(value);
                }
                None => self.data = Some(value.to_owned()),
            },
            _ => {} // id, retry and unknown fields do not matter to us
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_in_chunks(input: &[u8], size: usize) -> Vec<SseEvent> {
        let mut d = SseDecoder::new();
        input.chunks(size).flat_map(|c| d.push(c).expect("utf-8")).collect()
    }

    #[test]
    fn any_chunking_gives_the_same_events() {
        let input =
            "event: message_start\ndata: {\"a\":1}\n\n: ping\r\ndata: x\r\ndata: y\r\n\r\ndata:z\r\rdata: é\n\n";
        let expected = vec![
            SseEvent { event: Some("message_start".into()), data: "{\"a\":1}".into() },
            SseEvent { event: None, data: "x\ny".into() },
            SseEvent { event: None, data: "z".into() },
            SseEvent { event: None, data: "é".into() },
        ];
        for size in 1..=input.len() {
            assert_eq!(decode_in_chunks(input.as_bytes(), size), expected, "chunk size {size}");
        }
    }

    #[test]
    fn a_leading_byte_order_mark_is_dropped() {
        let input = "\u{feff}data: a\n\ndata: \u{feff}b\n\n";
        for size in 1..=input.len() {
            let events = decode_in_chunks(input.as_bytes(), size);
            let data: Vec<&str> = events.iter().map(|e| e.data.as_str()).collect();
            assert_eq!(data, vec!["a", "\u{feff}b"], "chunk size {size}");
        }
    }

    #[test]
    fn partial_event_is_reported() {
        let mut d = SseDecoder::new();
        assert!(d.push(b"data: {\"trunc").expect("utf-8").is_empty());
        assert!(d.has_partial_event());
    }
}
