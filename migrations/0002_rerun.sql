-- Re-runs. A run that re-runs one step of an earlier run with another worker names that run
-- (by its executor id, which still reads after the earlier run is deleted) and the step. A
-- step the re-run kept rather than ran names the run its output comes from.

ALTER TABLE runs ADD COLUMN rerun_of TEXT;
ALTER TABLE runs ADD COLUMN rerun_step INTEGER;
ALTER TABLE steps ADD COLUMN reused_from TEXT;
