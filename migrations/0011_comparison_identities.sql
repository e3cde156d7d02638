-- The identity (provider, model, endpoint, settings) of the worker that answered alone in a
-- comparison, so that the user's mark adds to that worker's learned profile and stops counting
-- once the worker is defined otherwise. Comparisons from before have none and count for no one.
ALTER TABLE comparisons ADD COLUMN worker_identity TEXT;
