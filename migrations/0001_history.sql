-- Run history: conversations, their messages, runs, the plans of each round, and every step.
-- Times are Unix milliseconds. Released migrations are never edited; add a new file instead
-- (a test compares each file's checksum with the released one).

CREATE TABLE conversations (
    id INTEGER PRIMARY KEY,
    title TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    updated_at INTEGER NOT NULL
);

CREATE TABLE runs (
    id INTEGER PRIMARY KEY,
    -- The executor's run id.
    uid TEXT NOT NULL UNIQUE,
    conversation_id INTEGER NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    question TEXT NOT NULL,
    -- The planner's description, or NULL for a written plan.
    conductor TEXT,
    -- The pool's workers as the run saw them (JSON array of {index, name, provider, model}).
    workers TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('running', 'finished', 'failed', 'cancelled', 'interrupted')),
    answer TEXT,
    error_kind TEXT,
    error TEXT,
    started_at INTEGER NOT NULL,
    finished_at INTEGER,
    rounds INTEGER NOT NULL DEFAULT 0,
    calls INTEGER NOT NULL DEFAULT 0,
    input_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0,
    cost_usd REAL NOT NULL DEFAULT 0,
    cost_complete INTEGER NOT NULL DEFAULT 1,
    wall_ms INTEGER
);
CREATE INDEX runs_conversation ON runs (conversation_id, id);
CREATE INDEX runs_running ON runs (status) WHERE status = 'running';

CREATE TABLE messages (
    id INTEGER PRIMARY KEY,
    conversation_id INTEGER NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    -- The run that produced an assistant message, or that a user message asked.
    run_id INTEGER REFERENCES runs (id) ON DELETE SET NULL,
    role TEXT NOT NULL CHECK (role IN ('user', 'assistant')),
    content TEXT NOT NULL,
    created_at INTEGER NOT NULL
);
CREATE INDEX messages_conversation ON messages (conversation_id, id);
CREATE INDEX messages_run ON messages (run_id);

CREATE TABLE plans (
    run_id INTEGER NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    round INTEGER NOT NULL,
    depth INTEGER NOT NULL,
    parent_round INTEGER,
    parent_step INTEGER,
    -- The conductor's whole text; NULL for a written plan.
    raw TEXT,
    -- The normalized lists, as `baton plan parse` prints them.
    plan TEXT NOT NULL,
    PRIMARY KEY (run_id, round)
);

CREATE TABLE steps (
    id INTEGER PRIMARY KEY,
    run_id INTEGER NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    round INTEGER NOT NULL,
    step INTEGER NOT NULL,
    worker_index INTEGER NOT NULL,
    worker TEXT NOT NULL,
    subtask TEXT NOT NULL,
    -- "all" or a JSON array of earlier step numbers.
    access TEXT NOT NULL,
    -- Exactly what the worker was sent: {"system": ..., "messages": [...]}; NULL if it never ran.
    request TEXT,
    status TEXT NOT NULL CHECK (status IN ('running', 'finished', 'failed', 'interrupted')),
    output TEXT,
    error_kind TEXT,
    error TEXT,
    input_tokens INTEGER,
    output_tokens INTEGER,
    cost_usd REAL,
    latency_ms INTEGER,
    retries INTEGER NOT NULL DEFAULT 0,
    UNIQUE (run_id, round, step)
);

-- The run's events in order, without the text deltas (the finished texts are in the rows above).
CREATE TABLE events (
    run_id INTEGER NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    seq INTEGER NOT NULL,
    event TEXT NOT NULL,
    PRIMARY KEY (run_id, seq)
) WITHOUT ROWID;

-- Full-text search. The index rows share the rowid of the row they index, so keeping them in
-- step costs a lookup by rowid, never a scan.
CREATE VIRTUAL TABLE run_text USING fts5 (question, answer, tokenize = 'unicode61 remove_diacritics 2');
CREATE VIRTUAL TABLE step_text USING fts5 (subtask, tokenize = 'unicode61 remove_diacritics 2');

CREATE TRIGGER runs_fts_insert AFTER INSERT ON runs BEGIN
    INSERT INTO run_text (rowid, question, answer) VALUES (new.id, new.question, new.answer);
END;
CREATE TRIGGER runs_fts_answer AFTER UPDATE OF answer ON runs BEGIN
    UPDATE run_text SET answer = new.answer WHERE rowid = new.id;
END;
CREATE TRIGGER runs_fts_delete AFTER DELETE ON runs BEGIN
    DELETE FROM run_text WHERE rowid = old.id;
END;
CREATE TRIGGER steps_fts_insert AFTER INSERT ON steps BEGIN
    INSERT INTO step_text (rowid, subtask) VALUES (new.id, new.subtask);
END;
CREATE TRIGGER steps_fts_delete AFTER DELETE ON steps BEGIN
    DELETE FROM step_text WHERE rowid = old.id;
END;
