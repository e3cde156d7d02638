import { describe, expect, it } from "vitest";
import type { Totals } from "../bindings";
import { figuresLine, totalsBreakdown } from "./figures";

const usage = (input: number, cached: number, written: number, output: number) => ({
  input_tokens: input,
  cached_input_tokens: cached,
  cache_write_input_tokens: written,
  output_tokens: output,
});

const totals = (complete: boolean, unknown: string[]): Totals => ({
  calls: 5,
  usage: usage(1500, 800, 0, 400),
  cost_usd: 0.0123,
  cost_complete: complete,
  conductor: { calls: 1, usage: usage(1000, 800, 0, 100), cost_usd: 0, cost_complete: true },
  workers: { calls: 4, usage: usage(500, 0, 0, 300), cost_usd: 0.0123, cost_complete: complete },
  cost_unknown_for: unknown,
  wall_ms: 1200,
  steps_finished: [0, 1],
  steps_failed: [],
  rounds: 1,
});

describe("figures", () => {
  it("writes a share as the engine does", () => {
    expect(figuresLine(totals(true, []).conductor)).toBe("1 call · 1000 in (800 cached) / 100 out tokens · $0");
    expect(figuresLine({ calls: 2, usage: usage(10, 4, 6, 1), cost_usd: 0.5, cost_complete: false })).toBe(
      "2 calls · 10 in (4 cached, 6 written to cache) / 1 out tokens · ≥ $0.50",
    );
  });

  it("splits conductor and workers and names unknown prices", () => {
    expect(totalsBreakdown(totals(true, []))).toEqual([
      "conductor: 1 call · 1000 in (800 cached) / 100 out tokens · $0",
      "workers: 4 calls · 500 in / 300 out tokens · $0.01",
    ]);
    expect(totalsBreakdown(totals(false, ["gpt", "the conductor"]))[2]).toBe("cost unknown for gpt, the conductor");
  });
});
