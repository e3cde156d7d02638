// The topology's own fold of run events, checked against recorded runs: the runs whose exports
// are pinned in `crates/baton-store/tests/fixtures/exports/` (the executor over loopback HTTP, a
// real SQLite file). The engine's `RunProgress` fold is checked against the same files in
// `crates/baton-store/tests/exports.rs`, so the graph and the command line read one run alike.
import { describe, expect, it } from "vitest";
import type { RunEvent } from "../bindings";
import conversation from "../../../crates/baton-store/tests/fixtures/exports/conversation.json";
import failedRun from "../../../crates/baton-store/tests/fixtures/exports/failed-run.json";
import { applyEvent, emptyTopology, findStep, type StepStatus } from "./topology";

interface RecordedStep {
  round: number;
  step: number;
  worker_index: number;
  status: string;
  output: string | null;
}
interface Recorded {
  run: { uid: string; status: string; answer: string | null };
  steps: RecordedStep[];
  events: unknown[];
}

const runs = [...(conversation.runs as unknown as Recorded[]), failedRun as unknown as Recorded];

// The history's step status, as the graph names it.
const shown: Record<string, StepStatus> = { finished: "done", failed: "failed", cancelled: "cancelled" };

describe("the topology of a recorded run", () => {
  it("covers runs that finished, re-used steps and failed", () => {
    expect(runs.map((r) => r.run.status)).toEqual(["finished", "finished", "failed"]);
  });

  for (const recorded of runs) {
    it(`matches the history's rows for ${recorded.run.uid} (${recorded.run.status})`, () => {
      let t = emptyTopology();
      for (const event of recorded.events) t = applyEvent(t, event as RunEvent);

      expect(t.status).toBe(recorded.run.status);
      expect(t.answer).toBe(recorded.run.answer);
      const top = t.rounds.find((r) => r.round === 0);
      expect(top?.steps.length).toBe(recorded.steps.filter((s) => s.round === 0).length);
      for (const row of recorded.steps) {
        const step = findStep(t, row.round, row.step);
        expect(step, `step ${row.round}/${row.step}`).toBeDefined();
        expect([step?.worker, step?.status]).toEqual([row.worker_index, shown[row.status]]);
        if (row.status === "finished") expect(step?.output).toBe(row.output);
      }
    });
  }
});
