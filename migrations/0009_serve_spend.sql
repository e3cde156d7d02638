-- What the OpenAI-compatible server (`baton serve`, the app's Local API) spent each day, for
-- its daily cap: `day` is days since 1970 (UTC). Kept here so that a server that restarts (the
-- app restarts its own when the pool changes) goes on counting the day instead of starting
-- again from nothing. Every server on this history shares the count.
CREATE TABLE serve_spend (
    day INTEGER PRIMARY KEY,
    usd REAL NOT NULL
);
