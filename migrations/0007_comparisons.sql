-- Compare in chat: one question answered by the conductor and by one worker alone, side by
-- side, and which answer the user marked better.
--
-- Both answers are runs of the conversation. Only the conductor's joins the conversation's
-- turns (what the conductor sees in a follow-up); the worker's run adds no messages. A deleted
-- run leaves its side NULL. `preferred` is NULL until the user marks one: `conductor`,
-- `single` (the worker alone) or `tie`.

CREATE TABLE comparisons (
    id INTEGER PRIMARY KEY,
    conversation_id INTEGER NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    conductor_run INTEGER REFERENCES runs (id) ON DELETE SET NULL,
    single_run INTEGER REFERENCES runs (id) ON DELETE SET NULL,
    -- The worker that answered alone, by name.
    worker TEXT NOT NULL,
    preferred TEXT CHECK (preferred IN ('conductor', 'single', 'tie')),
    created_at INTEGER NOT NULL,
    marked_at INTEGER
);
CREATE INDEX comparisons_conversation ON comparisons (conversation_id, id);
CREATE INDEX comparisons_conductor_run ON comparisons (conductor_run);
CREATE INDEX comparisons_single_run ON comparisons (single_run);
