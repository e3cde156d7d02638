-- Accounting split by caller, and prompt caching.
--
-- `runs.totals` holds the run's whole figures as the engine reports them (JSON of `Totals`):
-- calls, input/cached/output tokens and cost, split into the conductor's share and the
-- workers', and the names of callers with no known price. NULL for runs recorded before this
-- migration, whose flat columns (calls, input_tokens, ...) still hold their totals.
-- `cached_input_tokens` / `cache_write_input_tokens` are the parts of a step's input read from
-- and written to a provider's prompt cache; NULL before this migration.

ALTER TABLE runs ADD COLUMN totals TEXT;
ALTER TABLE steps ADD COLUMN cached_input_tokens INTEGER;
ALTER TABLE steps ADD COLUMN cache_write_input_tokens INTEGER;
