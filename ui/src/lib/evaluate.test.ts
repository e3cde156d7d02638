import { describe, expect, it } from "vitest";
import type { Report, StrategySummary } from "../bindings";
import { addProgress, chartData, defaultStrategy, emptyTally, strategyChoices, strategyName } from "./evaluate";

function usage(input_tokens: number, output_tokens: number) {
  return { input_tokens, output_tokens, cached_input_tokens: 0, cache_write_input_tokens: 0 };
}

function summary(strategy: string, accuracy: number, cost: number, pareto: boolean): StrategySummary {
  return {
    strategy, accuracy, stderr: 0, n: 4, runs: 4,
    figures: { calls: 4, usage: usage(100, 20), cost_usd: cost * 4, cost_complete: true },
    conductor_usage: usage(0, 0),
    cost_per_item_usd: cost, latency_p50_ms: 1, latency_p95_ms: 2,
    plan_validity: null, mean_steps: null, failures: 0, pareto,
  };
}

describe("evaluate", () => {
  it("offers every strategy for the pool's workers", () => {
    const ids = strategyChoices(["a", "b"]).map((c) => c.id);
    expect(ids).toEqual([
      "conductor", "single:a", "single:b", "moa", "router:lookup", "router:random", "best-of-n:a", "best-of-n:b", "oracle",
    ]);
  });

  it("ticks the comparison the screen is for by default", () => {
    const on = strategyChoices(["a"]).filter((c) => defaultStrategy(c.id, true)).map((c) => c.id);
    expect(on).toEqual(["conductor", "single:a", "router:lookup", "oracle"]);
    expect(defaultStrategy("conductor", false)).toBe(false);
  });

  it("names strategies in words, and keeps an id it does not know", () => {
    expect(
      ["conductor", "single:alpha", "moa", "router:lookup", "router:random", "best-of-n:beta", "best-of-n:beta:5", "oracle", "router:x", "new"].map(
        strategyName,
      ),
    ).toEqual([
      "Conductor", "alpha alone", "Mixture of agents", "Lookup router", "Random router", "beta, best of n", "beta, best of 5", "Oracle", "router:x", "new",
    ]);
  });

  it("keeps a running tally per strategy", () => {
    let t = emptyTally();
    t = addProgress(t, { type: "started", id: "e1", about: "3 items of mmlu" });
    t = addProgress(t, { type: "planned", total: 4, done: 1 });
    t = addProgress(t, { type: "scored", strategy: "conductor", item: "x", correct: true, cost_usd: 0.1, spent_usd: 0.1 });
    t = addProgress(t, { type: "scored", strategy: "conductor", item: "y", correct: false, cost_usd: 0.1, spent_usd: 0.2 });
    t = addProgress(t, { type: "note", text: "hello" });
    expect(t).toEqual({ id: "e1", total: 4, done: 3, spent: 0.2, by: { conductor: { right: 1, n: 2 } }, notes: ["hello"] });
  });

  it("draws dollars per item, or tokens where costs are unknown, and the front cheapest first", () => {
    const report = {
      cost_axis: "usd",
      pareto_front: ["single:a", "conductor"],
      strategies: [summary("conductor", 0.75, 0.02, true), summary("single:a", 0.5, 0.01, true), summary("moa", 0.5, 0.05, false)],
    } as unknown as Report;
    const { points, front } = chartData(report);
    expect(points.map((p) => [p.strategy, p.x, p.y])).toEqual([
      ["conductor", 0.02, 75], ["single:a", 0.01, 50], ["moa", 0.05, 50],
    ]);
    expect(front.map((p) => p.strategy)).toEqual(["single:a", "conductor"]);
    const tokens = chartData({ ...report, cost_axis: "tokens" } as Report);
    expect(tokens.points[0].x).toBe(30);
  });
});
