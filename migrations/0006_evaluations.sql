-- Evaluations (`baton eval`): one row per evaluation, one per (strategy, item, repeat) result.
-- An evaluation's runs are recorded like any other, each in a conversation of its own marked
-- with the evaluation, so they open with their topology but stay out of the chat's list.

ALTER TABLE conversations ADD COLUMN evaluation_id TEXT;

CREATE TABLE evaluations (
    -- The name the user gave (`--id`), or one Baton made.
    id TEXT PRIMARY KEY,
    -- The suite's name and the SHA-256 of its items: a resume on other items is refused.
    suite TEXT NOT NULL,
    suite_sha256 TEXT NOT NULL,
    -- JSON: strategies, repeats, calibration fraction, seed, sample size, spending cap, the
    -- choices made along the way (best-of-n's n, the MoA aggregator, the lookup table).
    config TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('running', 'finished', 'stopped', 'over_budget', 'failed')),
    -- Every dollar spent, runs that were stopped or refused by the cap included.
    spent_usd REAL NOT NULL DEFAULT 0,
    created_at INTEGER NOT NULL,
    updated_at INTEGER NOT NULL
);

CREATE TABLE eval_results (
    evaluation_id TEXT NOT NULL REFERENCES evaluations (id) ON DELETE CASCADE,
    -- `conductor`, `single:<worker>`, `moa`, `router:lookup`, `router:random`,
    -- `best-of-n:<worker>`, `oracle`.
    strategy TEXT NOT NULL,
    item_id TEXT NOT NULL,
    repeat INTEGER NOT NULL,
    split TEXT NOT NULL CHECK (split IN ('calibration', 'test')),
    category TEXT NOT NULL,
    -- The run in the history (`runs.uid`); for strategies built from other results (routers,
    -- the oracle), the run whose answer they take, if one.
    run_uid TEXT,
    answer TEXT,
    extracted TEXT,
    correct INTEGER NOT NULL,
    -- Why the item is wrong beyond its answer: the run failed, the sandbox stopped the code.
    error TEXT,
    -- Conductor runs: whether the plan was usable, and the steps that ran.
    plan_valid INTEGER,
    steps INTEGER,
    calls INTEGER NOT NULL,
    input_tokens INTEGER NOT NULL,
    cached_input_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    conductor_input_tokens INTEGER NOT NULL,
    conductor_cached_input_tokens INTEGER NOT NULL,
    conductor_output_tokens INTEGER NOT NULL,
    cost_usd REAL NOT NULL,
    cost_complete INTEGER NOT NULL,
    latency_ms INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    PRIMARY KEY (evaluation_id, strategy, item_id, repeat)
);
