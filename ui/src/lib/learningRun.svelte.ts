// The pool's learning run, kept outside the Workers screen: the run goes on while the user looks
// at another screen, and on return its progress, Stop and result are still there (a screen's own
// state would be lost with it, and "Learn this pool" would start the run a second time).
import { api, asAppError } from "../api";
import type { PoolLearning } from "../bindings";
import { addProgress, emptyTally, type Tally } from "./evaluate";

export const learningRun = $state({
  running: false,
  stopId: null as string | null,
  tally: emptyTally() as Tally,
  /** What the pool learned, as last read. */
  learning: null as PoolLearning | null,
  error: null as string | null,
  notice: null as string | null,
});

/** Reads what the pool learned again (after a save: a changed worker's profile is stale). */
export async function refreshLearning() {
  try {
    const learning = await api.poolLearning();
    // A run in flight ends with the newest figures; a read that started before it must not
    // replace them.
    if (!learningRun.running) learningRun.learning = learning;
    learningRun.error = null;
  } catch (e) {
    learningRun.error = asAppError(e).message;
  }
}

/**
 * Learns from `suite` (a built-in name or a file), `limit` items (null: all), with `plans`
 * sampled conductor plans per item (0: the workers alone only), spending at most `cap` dollars
 * (null: no cap).
 */
export async function learn(suite: string, limit: number | null, plans: number, cap: number | null) {
  if (learningRun.running) return;
  learningRun.error = null;
  learningRun.notice = null;
  learningRun.running = true;
  learningRun.tally = emptyTally();
  const id = crypto.randomUUID();
  learningRun.stopId = id;
  let failed: string | null = null;
  try {
    const result = await api.learnPool({ suite, limit, plans, max_cost_usd: cap }, id, (p) => (learningRun.tally = addProgress(learningRun.tally, p)));
    learningRun.learning = result.learning;
    if (result.ended === "stopped") learningRun.notice = "Stopped. What was measured is kept: learn the same suite and items again to go on.";
    if (result.ended === "over_budget") learningRun.notice =
        "The spending cap was reached; what was measured is kept: learn the same suite and items again with a higher cap to go on.";
  } catch (e) {
    failed = asAppError(e).message;
  } finally {
    learningRun.running = false;
    learningRun.stopId = null;
  }
  // Read again: the workers may have been saved while it ran, and a failed run may have
  // measured some items before it failed.
  await refreshLearning();
  if (failed) learningRun.error = failed;
}

export function stopLearning() {
  if (learningRun.stopId) void api.cancelRun(learningRun.stopId);
}
