-- The lock file that says a running run is still being recorded (see the store's `locks`): one
-- a store reuses run after run. Runs from before have none and were locked by their uid.
ALTER TABLE runs ADD COLUMN recorder TEXT;
