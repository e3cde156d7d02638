// A run's figures as people read them: the same lines the engine writes for the CLI and
// exports (`Figures::summary`, `Totals::breakdown`), so every surface says the same.

import type { Figures, Totals, WorkerFigures } from "../bindings";

export function formatCost(usd: number, complete = true): string {
  const s = usd === 0 ? "$0" : usd < 0.01 ? `$${usd.toFixed(4)}` : `$${usd.toFixed(2)}`;
  return complete ? s : `≥ ${s}`;
}

/** One line for a share of a run's figures, as the engine's `Figures::summary` writes it. */
export function figuresLine(f: Figures): string {
  const u = f.usage;
  let input = `${u.input_tokens} in`;
  if (u.cache_write_input_tokens > 0) {
    input += ` (${u.cached_input_tokens} cached, ${u.cache_write_input_tokens} written to cache)`;
  } else if (u.cached_input_tokens > 0) {
    input += ` (${u.cached_input_tokens} cached)`;
  }
  const calls = `${f.calls} call${f.calls === 1 ? "" : "s"}`;
  return `${calls} · ${input} / ${u.output_tokens} out tokens · ${formatCost(f.cost_usd, f.cost_complete)}`;
}

/** The conductor's and the workers' shares and unknown prices, as `Totals::breakdown` lists them. */
export function totalsBreakdown(t: Totals): string[] {
  const lines = [`conductor: ${figuresLine(t.conductor)}`, `workers: ${figuresLine(t.workers)}`];
  if (!t.cost_complete) {
    lines.push(t.cost_unknown_for.length ? `cost unknown for ${t.cost_unknown_for.join(", ")}` : "cost unknown for some calls");
  }
  return lines;
}


function ms(v: number): string {
  return v < 1000 ? `${v} ms` : `${(v / 1000).toFixed(1)} s`;
}

/**
 * A worker's record over the history, as the Workers & keys screen shows it: the parts of one
 * line, and whether it stands out as unreliable (a fifth or more of at least five calls failed)
 * or poor (under half right alone in its latest evaluation).
 */
export function workerRecord(f: WorkerFigures): { parts: string[]; unreliable: boolean; poor: boolean } {
  const parts = [`${f.calls} call${f.calls === 1 ? "" : "s"}`];
  if (f.failure_rate !== null) parts.push(`${(f.failure_rate * 100).toFixed(1)}% failed`);
  if (f.latency_p50_ms !== null && f.latency_p95_ms !== null) {
    parts.push(`${ms(f.latency_p50_ms)} typical (p50), ${ms(f.latency_p95_ms)} for the slowest 5%`);
  }
  parts.push(`${formatCost(f.cost_usd, f.cost_complete)} spent`);
  const e = f.evaluation;
  if (e) parts.push(`${(e.accuracy * 100).toFixed(1)}% right alone on ${e.suite} (${e.n} answers, evaluation ${e.evaluation_id})`);
  const unreliable = f.failure_rate !== null && f.calls >= 5 && f.failure_rate >= 0.2;
  const poor = e !== null && e.accuracy < 0.5;
  return { parts, unreliable, poor };
}
