import { describe, expect, it } from "vitest";
import type { Totals, WorkerFigures } from "../bindings";
import { figuresLine, totalsBreakdown, workerRecord } from "./figures";

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

describe("workerRecord", () => {
  const base: WorkerFigures = {
    worker: "w",
    calls: 10,
    finished: 7,
    failed: 3,
    cancelled: 0,
    failure_rate: 0.3,
    retries: 1,
    latency_p50_ms: 850,
    latency_p95_ms: 2400,
    input_tokens: 100,
    output_tokens: 50,
    cost_usd: 0.25,
    cost_complete: true,
    last_called_at: 1,
    evaluation: { evaluation_id: "e1", suite: "mmlu", accuracy: 0.4, n: 20, at: 1 },
  };

  it("reads as one line and flags a failing, poor worker", () => {
    const r = workerRecord(base);
    expect(r.parts).toEqual([
      "10 calls",
      "30.0% failed",
      "850 ms typical (p50), 2.4 s for the slowest 5%",
      "$0.25 spent",
      "40.0% right alone on mmlu (20 answers, evaluation e1)",
    ]);
    expect(r).toMatchObject({ unreliable: true, poor: true });
  });

  it("does not flag a worker on too few calls, and leaves out what is unknown", () => {
    const r = workerRecord({
      ...base,
      calls: 2,
      finished: 0,
      failed: 2,
      failure_rate: 1,
      latency_p50_ms: null,
      latency_p95_ms: null,
      cost_usd: 0,
      evaluation: null,
    });
    expect(r.parts).toEqual(["2 calls", "100.0% failed", "$0 spent"]);
    expect(r).toMatchObject({ unreliable: false, poor: false });
  });
});
