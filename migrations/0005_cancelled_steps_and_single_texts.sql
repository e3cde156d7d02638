-- Steps stopped mid-answer, and every text stored once.
--
-- `steps.status` may now be 'cancelled': the run was stopped (by the user, or a budget cap)
-- while the step was waiting or answering; `output` then holds the text that had arrived, cut
-- short (NULL if none had). SQLite cannot change a CHECK constraint in place, so the table is
-- rebuilt: same columns, same rows with the same ids (the full-text index `step_text` refers to
-- them), the same unique key and triggers.
--
-- Texts once. A step's `request` used to repeat the subtask and answer of every step it saw,
-- and its `step_started` event repeated them again, so a plan whose steps all see each other
-- grew with the square of its answers. From now on:
-- - `steps.request` is either what it was (`{"system", "messages": [{role, content}]}`, rows
--   written before this migration) or `{"system", "turns": [...]}`, where each turn is
--   `{"role", "subtask": [round, step]}` or `{"role", "output": [round, step]}` (that step's
--   subtask or output in the same run) or `{"role", "content"}` (the text itself).
-- - `events.elided` names the fields (a JSON array) whose text was left out of `event` because
--   a row holds it: `question` and `answer` (the run), `plan` and `raw` (the plan of the event's
--   round), `system` and `messages` (the step's request), `output` (the step). They are
--   stored as null in place, and filled in again when the run is read. NULL: the event is
--   whole (every row written before this migration).

CREATE TABLE steps_new (
    id INTEGER PRIMARY KEY,
    run_id INTEGER NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    round INTEGER NOT NULL,
    step INTEGER NOT NULL,
    worker_index INTEGER NOT NULL,
    worker TEXT NOT NULL,
    subtask TEXT NOT NULL,
    access TEXT NOT NULL,
    request TEXT,
    status TEXT NOT NULL CHECK (status IN ('running', 'finished', 'failed', 'cancelled', 'interrupted')),
    output TEXT,
    error_kind TEXT,
    error TEXT,
    input_tokens INTEGER,
    output_tokens INTEGER,
    cost_usd REAL,
    latency_ms INTEGER,
    retries INTEGER NOT NULL DEFAULT 0,
    reused_from TEXT,
    cached_input_tokens INTEGER,
    cache_write_input_tokens INTEGER,
    UNIQUE (run_id, round, step)
);

INSERT INTO steps_new (id, run_id, round, step, worker_index, worker, subtask, access, request, status, output,
                       error_kind, error, input_tokens, output_tokens, cost_usd, latency_ms, retries, reused_from,
                       cached_input_tokens, cache_write_input_tokens)
SELECT id, run_id, round, step, worker_index, worker, subtask, access, request, status, output,
       error_kind, error, input_tokens, output_tokens, cost_usd, latency_ms, retries, reused_from,
       cached_input_tokens, cache_write_input_tokens
FROM steps;

-- Dropping the table drops its triggers with it (and fires none: `step_text` keeps its rows).
DROP TABLE steps;
ALTER TABLE steps_new RENAME TO steps;

CREATE TRIGGER steps_fts_insert AFTER INSERT ON steps BEGIN
    INSERT INTO step_text (rowid, subtask) VALUES (new.id, new.subtask);
END;
CREATE TRIGGER steps_fts_delete AFTER DELETE ON steps BEGIN
    DELETE FROM step_text WHERE rowid = old.id;
END;

ALTER TABLE events ADD COLUMN elided TEXT;
