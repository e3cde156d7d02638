// What the pool learned, as the Workers & keys screen shows it: the same words `baton pool show`
// prints, so a profile reads the same wherever it is seen. Right of n always goes with its
// interval, so nobody reads 2 of 3 as 67%.

import type { CategoryRow, KindRoute, WorkerLearning } from "../bindings";
import { formatCost } from "./figures";

/** "3 of 4 right (95%: 30–95%)" */
export function rightOf(row: CategoryRow): string {
  const pct = (x: number) => Math.round(100 * x);
  return `${row.figures.right} of ${row.figures.n} right (95%: ${pct(row.low)}–${pct(row.high)}%)`;
}

/** Dollars per item, or "price unknown" for a worker whose calls have no price (never "$0"). */
export function costPerItem(w: WorkerLearning, row: CategoryRow): string {
  return w.priced ? `${formatCost(row.figures.cost_per_item_usd, row.figures.cost_complete)}/item` : "price unknown";
}

/** Whether a worker's profile is used, and why not. */
export function freshness(w: WorkerLearning): { used: boolean; text: string } {
  switch (w.freshness) {
    case "current":
      return { used: true, text: `learned in ${w.learned_in.join(", ")}` };
    case "stale":
      return {
        used: false,
        text: `stale, not used: learned as ${w.identity_learned ?? "?"}, now ${w.identity_now}; learn again`,
      };
    case "none":
      return { used: false, text: "not learned yet" };
  }
}

/** The user's compare-in-chat marks of the worker alone against the conductor, or null with none:
 * "Marked in chat against the conductor: better 2, as good 1, worse 0 (told to the conductor)". */
export function marksText(w: WorkerLearning): string | null {
  const m = w.marks;
  if (m.better + m.tie + m.worse === 0) return null;
  return `Marked in chat against the conductor: better ${m.better}, as good ${m.tie}, worse ${m.worse} (told to the conductor)`;
}

/** Where a kind of question goes, in words. */
export function routeText(r: KindRoute): string {
  switch (r.how) {
    case "always":
      return `${r.worker}, alone without a plan (the pool routes every question)`;
    case "clear":
      return `${r.worker}, alone without a plan (a clear margin)`;
    case "no_gain":
      return `${r.worker}, alone without a plan (plans not shown to do better)`;
    case "lead":
      return `${r.worker}, as the plan's lead (the conductor plans)`;
    case "workflow":
      return `${r.workflow ?? r.worker}, without a plan (a clear margin over every worker alone)`;
  }
}

/** The most runs a learning run's search makes for one item nothing else answered: every chain
 * of two workers, W·(W−1), and one fan-out. */
export function searchBound(workers: number): number {
  return workers < 2 ? 0 : workers * (workers - 1) + 1;
}

/** The calls a learning run asks: every worker once on every item. */
export function callsFor(workers: number, items: number): number {
  return workers * items;
}
