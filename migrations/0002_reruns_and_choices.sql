-- Re-runs, and the choices a conversation keeps.
--
-- A run that re-runs one step of an earlier run with another worker names that run (by its
-- executor id, which still reads after the earlier run is deleted) and the step. A step the
-- re-run kept rather than ran names the run its output comes from.
--
-- A conversation keeps which workers it may use (a JSON array of worker names, since pool
-- numbers change when the pool is edited; NULL for all of them) and whether its plans are
-- reviewed before they run.

ALTER TABLE runs ADD COLUMN rerun_of TEXT;
ALTER TABLE runs ADD COLUMN rerun_step INTEGER;
ALTER TABLE steps ADD COLUMN reused_from TEXT;
ALTER TABLE conversations ADD COLUMN workers TEXT;
ALTER TABLE conversations ADD COLUMN review INTEGER NOT NULL DEFAULT 0;
