import { describe, expect, it } from "vitest";
import type { CategoryRow, WorkerLearning } from "../bindings";
import { callsFor, costPerItem, freshness, marksText, rightOf, routeText, searchBound } from "./learning";

const row = (right: number, n: number, cost = 0.0012): CategoryRow => ({
  category: "arithmetic",
  label: "arithmetic",
  figures: { right, n, cost_per_item_usd: cost, cost_complete: true, latency_p50_ms: 900, tokens_per_item: 120 },
  low: 0.2077,
  high: 0.9385,
});

const worker = (over: Partial<WorkerLearning>): WorkerLearning => ({
  worker: "alpha",
  freshness: "current",
  identity_learned: "openai m-1",
  identity_now: "openai m-1",
  priced: true,
  learned_in: ["learn-mmlu-1"],
  categories: [row(2, 3)],
  kinds: [],
  marks: { better: 0, tie: 0, worse: 0 },
  ...over,
});

describe("a learned profile, as the Workers screen shows it", () => {
  it("gives right of n with its interval, never a bare percentage", () => {
    expect(rightOf(row(2, 3))).toBe("2 of 3 right (95%: 21–94%)");
  });

  it("says an unpriced worker's cost is unknown rather than $0", () => {
    expect(costPerItem(worker({}), row(2, 3))).toBe("$0.0012/item");
    expect(costPerItem(worker({ priced: false }), row(2, 3, 0))).toBe("price unknown");
  });

  it("says a changed worker's profile is stale and not used, with both identities", () => {
    const stale = freshness(worker({ freshness: "stale", identity_now: "openai m-2" }));
    expect(stale.used).toBe(false);
    expect(stale.text).toContain("openai m-1");
    expect(stale.text).toContain("openai m-2");
    expect(freshness(worker({ freshness: "none", learned_in: [] })).text).toBe("not learned yet");
    expect(freshness(worker({})).used).toBe(true);
  });

  it("tells apart a question answered alone from one the conductor plans", () => {
    expect(routeText({ category: "math", by_kind: false, label: "math", worker: "alpha", workflow: null, how: "clear" })).toContain("without a plan");
    expect(routeText({ category: "math", by_kind: false, label: "math", worker: "alpha", workflow: null, how: "lead" })).toContain("conductor plans");
    expect(routeText({ category: "math", by_kind: false, label: "math", worker: "alpha", workflow: null, how: "no_gain" })).toContain("plans not shown to do better");
    expect(routeText({ category: "math", by_kind: false, label: "math", worker: "alpha", workflow: null, how: "always" })).toContain("routes every question");
    expect(
      routeText({ category: "word", by_kind: false, label: "word", worker: "reader", workflow: "reader, then calc seeing reader's answer", how: "workflow" }),
    ).toBe("reader, then calc seeing reader's answer, without a plan (a clear margin over every worker alone)");
    expect(searchBound(3)).toBe(7);
    expect(searchBound(1)).toBe(0);
  });

  it("shows the chat marks only where the user marked something", () => {
    expect(marksText(worker({}))).toBeNull();
    expect(marksText(worker({ marks: { better: 2, tie: 0, worse: 1 } }))).toBe(
      "Marked in chat against the conductor: better 2, as good 0, worse 1 (told to the conductor)",
    );
  });

  it("counts one call per worker per item", () => {
    expect(callsFor(3, 20)).toBe(60);
  });
});
