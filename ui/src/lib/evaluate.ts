// The Evaluate screen's logic, apart from the view: which strategies a pool offers, the
// running tally while an evaluation goes, and the points of the cost–accuracy chart.

import type { EvalProgress, Report, StrategySummary } from "../bindings";

/** The strategies offered for a pool with these workers, in the order the table shows them. */
export function strategyChoices(workers: string[]): Array<{ id: string; label: string }> {
  const out = [{ id: "conductor", label: "Conductor (your pool, as the chat runs it)" }];
  for (const w of workers) out.push({ id: `single:${w}`, label: `${w} alone` });
  out.push(
    { id: "moa", label: "Mixture of agents (all answer, the strongest aggregates)" },
    { id: "router:lookup", label: "Lookup router (best worker per category)" },
    { id: "router:random", label: "Random router" },
  );
  for (const w of workers) out.push({ id: `best-of-n:${w}`, label: `${w}, best of n (at the conductor's cost)` });
  out.push({ id: "oracle", label: "Oracle (right if any worker is: the ceiling)" });
  return out;
}

/** A strategy id as the table and the chart name it: `single:alpha` is "alpha alone". */
export function strategyName(id: string): string {
  const colon = id.indexOf(":");
  const kind = colon < 0 ? id : id.slice(0, colon);
  const rest = colon < 0 ? "" : id.slice(colon + 1);
  if (kind === "conductor" && !rest) return "Conductor";
  if (kind === "moa" && !rest) return "Mixture of agents";
  if (kind === "oracle" && !rest) return "Oracle";
  if (kind === "single" && rest) return `${rest} alone`;
  if (id === "router:lookup") return "Lookup router";
  if (id === "router:random") return "Random router";
  if (kind === "best-of-n" && rest) {
    // `best-of-n:W` or `best-of-n:W:N`.
    const [, worker, n] = /^(.*?)(?::(\d+))?$/.exec(rest) ?? [];
    return `${worker}, best of ${n ?? "n"}`;
  }
  return id;
}

/** Ticked until the user says otherwise: the conductor (when one is configured), every worker
 * alone, the lookup router and the oracle: the comparison the screen exists for. */
export function defaultStrategy(id: string, hasConductor: boolean): boolean {
  return (id === "conductor" && hasConductor) || id.startsWith("single:") || id === "router:lookup" || id === "oracle";
}

/** What the screen shows while an evaluation runs. */
export type Tally = {
  id: string | null;
  total: number;
  done: number;
  spent: number;
  /** Per strategy: right and scored so far. */
  by: Record<string, { right: number; n: number }>;
  notes: string[];
};

export const emptyTally = (): Tally => ({ id: null, total: 0, done: 0, spent: 0, by: {}, notes: [] });

/** Folds one piece of progress into the tally (a new object, so views update). */
export function addProgress(t: Tally, p: EvalProgress): Tally {
  switch (p.type) {
    case "started":
      return { ...t, id: p.id };
    case "planned":
      return { ...t, total: p.total, done: p.done };
    case "note":
      return { ...t, notes: [...t.notes, p.text] };
    case "scored": {
      const before = t.by[p.strategy] ?? { right: 0, n: 0 };
      const by = { ...t.by, [p.strategy]: { right: before.right + (p.correct ? 1 : 0), n: before.n + 1 } };
      return { ...t, done: t.done + 1, spent: p.spent_usd, by };
    }
  }
}

/** A strategy's x on the chart: dollars per item, or tokens per item when costs are unknown. */
export function costOf(report: Report, s: StrategySummary): number {
  if (report.cost_axis === "usd") return s.cost_per_item_usd;
  return (s.figures.usage.input_tokens + s.figures.usage.output_tokens) / Math.max(1, s.runs);
}

export type ChartPoint = { x: number; y: number; strategy: string; front: boolean };

/** The chart's points (accuracy in percent) and the front's line, cheapest first. */
export function chartData(report: Report): { points: ChartPoint[]; front: ChartPoint[] } {
  const points = report.strategies.map((s) => ({
    x: costOf(report, s),
    y: 100 * s.accuracy,
    strategy: s.strategy,
    front: s.pareto,
  }));
  const front = report.pareto_front
    .map((name) => points.find((p) => p.strategy === name))
    .filter((p): p is ChartPoint => p !== undefined);
  return { points, front };
}

/** "62.5% ± 4.1" */
export const percent = (x: number, se?: number) =>
  `${(100 * x).toFixed(1)}%${se !== undefined ? ` ± ${(100 * se).toFixed(1)}` : ""}`;
