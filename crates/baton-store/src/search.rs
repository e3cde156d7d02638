//! Full-text search over the runs' questions, answers and step subtasks (FTS5).

use sqlx::Row;

use crate::records::status;
use crate::{SearchHit, Store, StoreError};

impl Store {
    /// Runs whose question, answer or step subtasks contain every word of `query` (the last
    /// word also as a prefix), newest first, one hit per run.
    pub async fn search(&self, query: &str, limit: u32) -> Result<Vec<SearchHit>, StoreError> {
        let Some(fts) = fts_query(query) else { return Ok(Vec::new()) };
        // Newest first: FTS5 walks an index in rowid order and stops at the limit, so a word
        // that matches most of the history costs as little as a rare one (ranking by relevance
        // would score every match first: ~0.6 s for a common word over 100k runs).
        // Matches are marked with \x02 and \x03 (which text never holds) to tell which column
        // matched; they become [ and ] for display.
        let rows = sqlx::query(
            "SELECT * FROM (
                 SELECT r.id, r.conversation_id, r.question, r.status, r.started_at,
                        snippet(run_text, 0, char(2), char(3), '…', 12) AS s0,
                        snippet(run_text, 1, char(2), char(3), '…', 12) AS s1
                 FROM run_text JOIN runs r ON r.id = run_text.rowid
                 WHERE run_text MATCH ?1 ORDER BY run_text.rowid DESC LIMIT ?2)
             UNION ALL
             SELECT * FROM (
                 SELECT r.id, r.conversation_id, r.question, r.status, r.started_at,
                        NULL AS s0, snippet(step_text, 0, char(2), char(3), '…', 12) AS s1
                 FROM step_text JOIN steps s ON s.id = step_text.rowid JOIN runs r ON r.id = s.run_id
                 WHERE step_text MATCH ?1 ORDER BY step_text.rowid DESC LIMIT ?2)
             ORDER BY id DESC",
        )
        .bind(&fts)
        .bind(limit.saturating_mul(4))
        .fetch_all(&self.pool)
        .await?;
        let mut seen = std::collections::HashSet::new();
        let mut hits = Vec::new();
        for r in &rows {
            let id: i64 = r.get("id");
            if !seen.insert(id) {
                continue;
            }
            let s0: Option<String> = r.get("s0");
            let s1: String = r.get("s1");
            let (matched, snippet) = match s0 {
                Some(q) if q.contains('\u{2}') => ("question", q),
                Some(_) => ("answer", s1),
                None => ("subtask", s1),
            };
            hits.push(SearchHit {
                id,
                conversation_id: r.get("conversation_id"),
                question: r.get("question"),
                status: status(r.get("status"))?,
                started_at: r.get("started_at"),
                matched: matched.to_owned(),
                snippet: snippet.replace('\u{2}', "[").replace('\u{3}', "]"),
            });
            if hits.len() == limit as usize {
                break;
            }
        }
        Ok(hits)
    }
}

/// A user's words as an FTS5 query: each word quoted (so punctuation is never syntax), all of
/// them required, the last one also as a prefix so results come while typing.
fn fts_query(query: &str) -> Option<String> {
    let words: Vec<String> = query
        .split(|c: char| !c.is_alphanumeric() && c != '\'' && c != '_')
        .filter(|w| !w.is_empty())
        .map(|w| format!("\"{}\"", w.replace('"', "\"\"")))
        .collect();
    let (last, rest) = words.split_last()?;
    let mut q = rest.join(" ");
    if !q.is_empty() {
        q.push(' ');
    }
    q.push_str(last);
    q.push('*');
    Some(q)
}

#[cfg(test)]
mod tests {
    use super::fts_query;

    #[test]
    fn search_words_are_quoted_and_the_last_is_a_prefix() {
        assert_eq!(fts_query("sky blue").as_deref(), Some("\"sky\" \"blue\"*"));
        assert_eq!(fts_query("  \"quote\" AND -x: ").as_deref(), Some("\"quote\" \"AND\" \"x\"*"));
        assert_eq!(fts_query(" -- "), None);
    }
}
