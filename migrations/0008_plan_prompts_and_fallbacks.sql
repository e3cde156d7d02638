-- How each plan came to be: the conductor's exact request, the attempts that were rejected,
-- and whether the plan is a fallback.
--
-- `prompt` is the conductor's request as JSON (`{"version", "system", "messages"}`), so training
-- data exported later uses the words that produced the plan, not a prompt rebuilt from today's
-- pool. `rejected` is a JSON array of `{"reason", "raw", "prompt"}`, one per attempt that could not be
-- used (it failed, copied an example, or gave no worker the question). `fallback` says why the
-- plan is one worker alone instead of the conductor's. All NULL for plans recorded before this
-- migration, for written plans, and (`rejected`, `fallback`) when nothing was rejected.

ALTER TABLE plans ADD COLUMN prompt TEXT;
ALTER TABLE plans ADD COLUMN rejected TEXT;
ALTER TABLE plans ADD COLUMN fallback TEXT;
