-- What each plan cost, and why its generation ended.
--
-- A plan's tokens are the conductor's own spend (prompt, the part of it served from the prefix
-- cache, and the plan text), kept apart from the workers' steps. The stop reason is what the
-- model or provider said ended the plan ("stop", "length", ...), so a plan that ran into its
-- token cap can be told from one that ended. All NULL for plans recorded before this migration.

ALTER TABLE plans ADD COLUMN input_tokens INTEGER;
ALTER TABLE plans ADD COLUMN cached_input_tokens INTEGER;
ALTER TABLE plans ADD COLUMN output_tokens INTEGER;
ALTER TABLE plans ADD COLUMN stop_reason TEXT;
