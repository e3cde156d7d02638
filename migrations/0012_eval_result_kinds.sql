-- The kind of each evaluated item (`number`, `choice`, `code`, `exact`) beside its category, so
-- a learned profile tells which worker is good at a kind of question across categories too thin
-- to choose by on their own (MMLU's subjects). Results from before have none: where an item had
-- no category of its own, its category is its kind, and is read as such.
ALTER TABLE eval_results ADD COLUMN kind TEXT;
