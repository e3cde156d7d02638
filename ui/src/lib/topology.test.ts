import { describe, expect, it } from "vitest";
import type { Access, Figures, Plan, RunEvent, RunTree, StepRecord, Totals, WorkerInfo } from "../bindings";
import {
  ANSWER_ID,
  applyEvent,
  emptyTopology,
  findStep,
  fromRunTree,
  graphKey,
  graphOf,
  layout,
  nodeStatus,
  parseNodeId,
  planId,
  rerunSteps,
  stepId,
  type GraphEdge,
  type Topology,
  type TopologyGraph,
  type TopologyLayout,
} from "./topology";

// ---- Builders -------------------------------------------------------------------------------

const WORKERS: WorkerInfo[] = ["alpha", "beta", "gamma"].map((name, index) => ({
  index,
  name,
  provider: "openai",
  model: `model-${name}`,
  description: null,
}));
const CONDUCTOR = WORKERS.length;

const NONE: Figures = {
  calls: 0,
  usage: { input_tokens: 0, output_tokens: 0, cached_input_tokens: 0, cache_write_input_tokens: 0 },
  cost_usd: 0,
  cost_complete: true,
};

const TOTALS: Totals = {
  calls: 0,
  usage: { input_tokens: 0, output_tokens: 0, cached_input_tokens: 0, cache_write_input_tokens: 0 },
  cost_usd: 0,
  cost_complete: true,
  conductor: NONE,
  workers: NONE,
  cost_unknown_for: [],
  wall_ms: 0,
  steps_finished: [],
  steps_failed: [],
  rounds: 1,
};

function plan(steps: Array<[worker: number, access: Access]>): Plan {
  return {
    model_id: steps.map(([w]) => w),
    subtasks: steps.map((_, i) => `subtask ${i}`),
    access_list: steps.map(([, a]) => a),
  };
}

function fold(events: RunEvent[]): Topology {
  return events.reduce(applyEvent, emptyTopology());
}

const started = (): RunEvent => ({ type: "run_started", run_id: "run-1", question: "q?", workers: WORKERS });

/** Events of a round whose steps all run and finish in order. */
function roundEvents(round: number, p: Plan, depth = 0, parent?: { round: number; step: number }): RunEvent[] {
  const events: RunEvent[] = [
    { type: "plan_started", round, depth, parent },
    { type: "plan_delta", round, text: "model_id = " },
    { type: "plan_ready", round, depth, parent, plan: p, raw: "model_id = ..." },
  ];
  p.model_id.forEach((worker, step) => {
    events.push(
      { type: "step_started", round, step, worker, system: null, messages: [{ role: "user", content: p.subtasks[step] }] },
      { type: "step_delta", round, step, text: "ans" },
      { type: "step_delta", round, step, text: "wer" },
      {
        type: "step_finished",
        round,
        step,
        output: `answer ${round}.${step}`,
        usage: { input_tokens: 10, output_tokens: 5, cached_input_tokens: 0, cache_write_input_tokens: 0 },
        cost_usd: 0.001,
        latency_ms: 100,
        retries: 0,
      },
    );
  });
  return events;
}

function edgeSet(edges: GraphEdge[], kind?: GraphEdge["kind"]): string[] {
  return edges
    .filter((e) => kind === undefined || e.kind === kind)
    .map((e) => `${e.from}->${e.to}`)
    .sort();
}

// ---- Events → model → graph -------------------------------------------------------------------

describe("applyEvent and graphOf", () => {
  it('draws an edge from every earlier step for "all"', () => {
    const t = fold([
      started(),
      ...roundEvents(0, plan([[0, []], [1, "all"], [2, "all"]])),
      { type: "run_finished", answer: "a", totals: TOTALS },
    ]);
    expect(t.rounds[0].steps.map((s) => s.access)).toEqual([[], [0], [0, 1]]);
    const g = graphOf(t);
    expect(edgeSet(g.edges, "access")).toEqual(["r0s0->r0s1", "r0s0->r0s2", "r0s1->r0s2"]);
    expect(edgeSet(g.edges, "plan")).toEqual(["r0plan->r0s0"]);
    expect(edgeSet(g.edges, "answer")).toEqual(["r0s2->answer"]);
    expect(g.nodes.map((n) => n.id)).toEqual(["r0plan", "r0s0", "r0s1", "r0s2", ANSWER_ID]);
    expect(g.nodes.find((n) => n.id === "r0plan")?.label).toBe("Conductor (round 0)");
    expect(t.status).toBe("finished");
    expect(t.answer).toBe("a");
  });

  it("draws edges from exactly the listed steps", () => {
    const t = fold([started(), ...roundEvents(0, plan([[0, []], [1, []], [2, [1]], [0, [0, 2]]]))]);
    const g = graphOf(t);
    expect(edgeSet(g.edges, "access")).toEqual(["r0s0->r0s3", "r0s1->r0s2", "r0s2->r0s3"]);
    expect(edgeSet(g.edges, "plan")).toEqual(["r0plan->r0s0", "r0plan->r0s1"]);
    expect(edgeSet(g.edges, "answer")).toEqual(["r0s3->answer"]);
  });

  it("starts every step with empty access from the plan node", () => {
    const t = fold([started(), ...roundEvents(0, plan([[0, []], [1, []], [2, []]]))]);
    const g = graphOf(t);
    expect(edgeSet(g.edges, "access")).toEqual([]);
    expect(edgeSet(g.edges, "plan")).toEqual(["r0plan->r0s0", "r0plan->r0s1", "r0plan->r0s2"]);
  });

  it("fills in step details as the events come", () => {
    const t = fold([started(), ...roundEvents(0, plan([[1, []]]))]);
    const s = findStep(t, 0, 0)!;
    expect(s).toMatchObject({
      worker: 1,
      worker_name: "beta",
      subtask: "subtask 0",
      status: "done",
      output: "answer 0.0",
      usage: { input_tokens: 10, output_tokens: 5, cached_input_tokens: 0, cache_write_input_tokens: 0 },
      cost_usd: 0.001,
      latency_ms: 100,
      retries: 0,
      error: null,
    });
    expect(s.request).toEqual({ system: null, messages: [{ role: "user", content: "subtask 0" }] });
    expect(t.rounds[0].raw).toBe("model_id = ...");
    expect(t.rounds[0].status).toBe("ready");
  });

  it("streams plan text and step text", () => {
    const t = fold([
      started(),
      { type: "plan_started", round: 0, depth: 0 },
      { type: "plan_delta", round: 0, text: "model_id" },
      { type: "plan_delta", round: 0, text: " = [0]" },
    ]);
    expect(t.rounds[0]).toMatchObject({ status: "planning", raw: "model_id = [0]", steps: [] });
    // Only the plan node while planning; no answer node until there is a last step.
    expect(graphOf(t).nodes.map((n) => n.id)).toEqual(["r0plan"]);

    applyEvent(t, { type: "plan_ready", round: 0, depth: 0, plan: plan([[0, []]]) });
    expect(t.rounds[0].raw).toBe("model_id = [0]");
    expect(findStep(t, 0, 0)?.status).toBe("waiting");
    applyEvent(t, { type: "step_started", round: 0, step: 0, worker: 0, system: "sys", messages: [] });
    applyEvent(t, { type: "step_delta", round: 0, step: 0, text: "Hel" });
    applyEvent(t, { type: "step_delta", round: 0, step: 0, text: "lo" });
    expect(findStep(t, 0, 0)).toMatchObject({ status: "running", output: "Hello" });
  });

  it("keeps rejected plans with their reasons and marks a fallback", () => {
    const t = fold([
      started(),
      { type: "plan_started", round: 0, depth: 0 },
      { type: "plan_delta", round: 0, text: "copied plan" },
      { type: "plan_rejected", round: 0, reason: "step 0 copies an example", retry: true },
      { type: "plan_delta", round: 0, text: "second plan" },
      { type: "plan_rejected", round: 0, reason: "step 0 is about an example's question", raw: "second plan", retry: false },
      { type: "plan_ready", round: 0, depth: 0, plan: plan([[1, []]]), fallback: "…; the question went to b alone" },
    ]);
    expect(t.rounds[0].rejected).toEqual([
      { reason: "step 0 copies an example", raw: "copied plan" },
      { reason: "step 0 is about an example's question", raw: "second plan" },
    ]);
    expect(t.rounds[0]).toMatchObject({ raw: null, fallback: "…; the question went to b alone", status: "ready" });
    expect(graphOf(t).nodes.find((n) => n.kind === "conductor")?.label).toBe("Conductor (round 0) · fallback");
    // A plan the conductor wrote is not marked.
    const plain = fold([started(), { type: "plan_ready", round: 0, depth: 0, plan: plan([[0, []]]) }]);
    expect(plain.rounds[0]).toMatchObject({ fallback: null, rejected: [] });
    expect(graphOf(plain).nodes.find((n) => n.kind === "conductor")?.label).toBe("Conductor (round 0)");
  });

  it("accepts a given plan with no plan_started", () => {
    const t = fold([started(), { type: "plan_ready", round: 0, depth: 0, plan: plan([[2, []]]) }]);
    expect(t.rounds[0]).toMatchObject({ round: 0, status: "ready", raw: null, parent: null });
    expect(findStep(t, 0, 0)?.worker_name).toBe("gamma");
  });

  it("opens a nested round for a step given to the conductor", () => {
    const parent = { round: 0, step: 1 };
    const t = fold([
      started(),
      { type: "plan_started", round: 0, depth: 0 },
      { type: "plan_ready", round: 0, depth: 0, plan: plan([[0, []], [CONDUCTOR, "all"], [1, [1]]]) },
      // Step 0 runs to the end.
      ...roundEvents(0, plan([[0, []]])).filter((e) => "step" in e),
      { type: "step_started", round: 0, step: 1, worker: CONDUCTOR, system: null, messages: [] },
      ...roundEvents(1, plan([[2, []], [0, "all"]]), 1, parent),
    ]);
    expect(findStep(t, 0, 1)).toMatchObject({ worker: CONDUCTOR, worker_name: "conductor", status: "running" });
    expect(t.rounds[1]).toMatchObject({ round: 1, depth: 1, parent });

    const g = graphOf(t);
    expect(edgeSet(g.edges, "recursion")).toEqual(["r0s1->r1plan"]);
    expect(edgeSet(g.edges, "plan")).toEqual(["r0plan->r0s0", "r1plan->r1s0"]);
    expect(edgeSet(g.edges, "access")).toEqual(["r0s0->r0s1", "r0s1->r0s2", "r1s0->r1s1"]);
    // The answer comes from the top round's last step, not the nested round's.
    expect(edgeSet(g.edges, "answer")).toEqual(["r0s2->answer"]);
    expect(g.clusters).toEqual([
      { id: "round0", round: 0, depth: 0, parent: null, label: "Round 0" },
      { id: "round1", round: 1, depth: 1, parent: "round0", label: "Round 1 · depth 1" },
    ]);
    expect(g.nodes.find((n) => n.id === "r1s0")?.cluster).toBe("round1");
    expect(g.nodes.find((n) => n.id === "r0s1")?.worker).toBe("conductor");
  });

  it("voids the text of a retried attempt and counts the retry", () => {
    const t = fold([
      started(),
      { type: "plan_ready", round: 0, depth: 0, plan: plan([[0, []]]) },
      { type: "step_started", round: 0, step: 0, worker: 0, system: null, messages: [] },
      { type: "step_delta", round: 0, step: 0, text: "half an answ" },
      {
        type: "step_retrying",
        round: 0,
        step: 0,
        attempt: 1,
        error: { kind: "network", message: "reset" },
        delay_ms: 500,
      },
    ]);
    expect(findStep(t, 0, 0)).toMatchObject({ status: "running", output: "", retries: 1 });
    applyEvent(t, { type: "step_delta", round: 0, step: 0, text: "fresh" });
    expect(findStep(t, 0, 0)?.output).toBe("fresh");
  });

  it("marks failed steps, including ones that never started", () => {
    const t = fold([
      started(),
      { type: "plan_started", round: 0, depth: 0 },
      { type: "plan_ready", round: 0, depth: 0, plan: plan([[0, []], [1, [0]], [2, []]]) },
      { type: "step_started", round: 0, step: 0, worker: 0, system: null, messages: [] },
      { type: "step_started", round: 0, step: 2, worker: 2, system: null, messages: [] },
      { type: "step_failed", round: 0, step: 0, error: { kind: "auth", message: "bad key", status: 401 } },
      { type: "step_failed", round: 0, step: 1, error: { kind: "dependency_failed", message: "step 0 failed" } },
      { type: "run_failed", error: { kind: "step_failed", message: "step 1 failed" }, totals: TOTALS },
    ]);
    expect(findStep(t, 0, 0)).toMatchObject({ status: "failed", error: { kind: "auth", message: "bad key" } });
    expect(findStep(t, 0, 1)).toMatchObject({ status: "failed", request: null, error: { kind: "dependency_failed" } });
    expect(findStep(t, 0, 2)?.status).toBe("running");
    expect(t.status).toBe("failed");
    expect(t.error?.kind).toBe("step_failed");
    const answer = graphOf(t).nodes.find((n) => n.id === ANSWER_ID)!;
    expect(nodeStatus(t, answer)).toBe("failed");
  });

  it("shows a plan that never came as failed once the run is over", () => {
    const t = fold([started(), { type: "plan_started", round: 0, depth: 0 }]);
    const planNode = graphOf(t).nodes[0];
    expect(nodeStatus(t, planNode)).toBe("running");
    applyEvent(t, { type: "run_failed", error: { kind: "conductor", message: "no plan" }, totals: TOTALS });
    expect(nodeStatus(t, planNode)).toBe("failed");
  });

  it("ignores events for steps it does not know", () => {
    const t = fold([started(), { type: "step_delta", round: 3, step: 9, text: "stray" }]);
    expect(t.rounds).toEqual([]);
  });

  it("starts over on a new run", () => {
    const t = fold([started(), ...roundEvents(0, plan([[0, []]])), { type: "run_cancelled", totals: TOTALS }]);
    expect(t.status).toBe("cancelled");
    applyEvent(t, { type: "run_started", run_id: "run-2", question: "again", workers: WORKERS });
    expect(t).toMatchObject({ run_id: "run-2", status: "running", rounds: [], totals: null });
  });

  it("names nodes so a selection can be resolved", () => {
    expect(parseNodeId(stepId(2, 4))).toEqual({ kind: "step", round: 2, step: 4 });
    expect(parseNodeId(planId(3))).toEqual({ kind: "conductor", round: 3 });
    expect(parseNodeId(ANSWER_ID)).toEqual({ kind: "answer" });
    expect(parseNodeId("round0")).toBeNull();
  });

  it("keeps the graph key unchanged while only text streams", () => {
    const t = fold([started(), { type: "plan_ready", round: 0, depth: 0, plan: plan([[0, []], [1, "all"]]) }]);
    const before = graphKey(graphOf(t));
    applyEvent(t, { type: "step_started", round: 0, step: 0, worker: 0, system: null, messages: [] });
    applyEvent(t, { type: "step_delta", round: 0, step: 0, text: "tok" });
    expect(graphKey(graphOf(t))).toBe(before);
    applyEvent(t, { type: "plan_started", round: 1, depth: 1, parent: { round: 0, step: 1 } });
    expect(graphKey(graphOf(t))).not.toBe(before);
  });
});

// ---- Stored runs ------------------------------------------------------------------------------

describe("fromRunTree", () => {
  // One run with recursion, both as the live events and as the history stores it.
  const top = plan([[0, []], [CONDUCTOR, "all"], [1, [1]]]);
  const nested = plan([[2, []], [0, "all"]]);
  const parent = { round: 0, step: 1 };

  const liveEvents: RunEvent[] = [
    started(),
    // The plan, then step 0 runs; step 1 opens round 1; step 2 fails.
    ...roundEvents(0, top).filter((e) => !("step" in e) || e.step === 0),
    { type: "step_started", round: 0, step: 1, worker: CONDUCTOR, system: null, messages: [] },
    ...roundEvents(1, nested, 1, parent),
    {
      type: "step_finished",
      round: 0,
      step: 1,
      output: "answer 1.1",
      usage: { input_tokens: 0, output_tokens: 0, cached_input_tokens: 0, cache_write_input_tokens: 0 },
      cost_usd: 0,
      latency_ms: 300,
      retries: 0,
    },
    { type: "step_started", round: 0, step: 2, worker: 1, system: "be brief", messages: [] },
    { type: "step_failed", round: 0, step: 2, error: { kind: "timeout", message: "too slow" } },
    { type: "run_failed", error: { kind: "step_failed", message: "the last step failed" }, totals: TOTALS },
  ];

  type Extra = Partial<StepRecord>;
  const record = (round: number, step: number, worker: number, access: Access, extra: Extra): StepRecord => ({
    round,
    step,
    worker_index: worker,
    worker: worker === CONDUCTOR ? "conductor" : WORKERS[worker].name,
    subtask: `subtask ${step}`,
    access,
    request: { system: null, messages: [] },
    status: "finished",
    output: `answer ${round}.${step}`,
    error_kind: null,
    error: null,
    input_tokens: 10,
    cached_input_tokens: 0,
    cache_write_input_tokens: 0,
    output_tokens: 5,
    cost_usd: 0.001,
    latency_ms: 100,
    retries: 0,
    reused_from: null,
    ...extra,
  });

  const tree: RunTree = {
    run: {
      id: 1,
      uid: "run-1",
      conversation_id: 1,
      question: "q?",
      conductor: "local",
      workers: WORKERS,
      status: "failed",
      answer: null,
      error_kind: "step_failed",
      error: "the last step failed",
      started_at: 0,
      finished_at: 1,
      rounds: 2,
      calls: 4,
      input_tokens: 30,
      output_tokens: 15,
      cost_usd: 0.003,
      cost_complete: true,
      totals: null,
      wall_ms: 900,
      rerun_of: null,
    },
    plans: [
      { round: 1, depth: 1, parent, raw: "model_id = ...", plan: nested, usage: null, stop_reason: null, prompt: null, rejected: [], fallback: null },
      { round: 0, depth: 0, parent: null, raw: "model_id = ...", plan: top, usage: null, stop_reason: null, prompt: null, rejected: [], fallback: null },
    ],
    steps: [
      record(0, 0, 0, [], {}),
      record(0, 1, CONDUCTOR, "all", {
        output: "answer 1.1",
        input_tokens: 0,
        output_tokens: 0,
        cost_usd: 0,
        latency_ms: 300,
      }),
      record(1, 0, 2, [], {}),
      record(1, 1, 0, "all", {}),
      record(0, 2, 1, [1], {
        status: "failed",
        output: null,
        error_kind: "timeout",
        error: "too slow",
        input_tokens: null,
        output_tokens: null,
        cost_usd: null,
        latency_ms: null,
      }),
    ],
    events: [],
  };

  it("builds the same graph as the live events", () => {
    const live = graphOf(fold(liveEvents));
    const stored = graphOf(fromRunTree(tree));
    expect(stored).toEqual(live);
    expect(edgeSet(stored.edges, "recursion")).toEqual(["r0s1->r1plan"]);
  });

  it("maps stored statuses and figures", () => {
    const t = fromRunTree(tree);
    expect(t.status).toBe("failed");
    expect(t.error).toEqual({ kind: "step_failed", message: "the last step failed" });
    expect(t.rounds.map((r) => r.round)).toEqual([0, 1]);
    expect(findStep(t, 0, 2)).toMatchObject({ status: "failed", usage: null, cost_usd: null, error: { kind: "timeout" } });
    expect(findStep(t, 1, 1)).toMatchObject({ status: "done", output: "answer 1.1" });
    expect(findStep(t, 1, 1)?.usage).toEqual({ input_tokens: 10, output_tokens: 5, cached_input_tokens: 0, cache_write_input_tokens: 0 });
    expect(t.totals).toMatchObject({ calls: 4, wall_ms: 900, steps_finished: [0, 1], steps_failed: [2], rounds: 2 });
  });

  it("reads interrupted steps and runs as failed, and unrecorded steps as waiting", () => {
    const interrupted: RunTree = {
      ...tree,
      run: { ...tree.run, status: "interrupted", error_kind: null, error: null },
      steps: [record(0, 0, 0, [], { status: "interrupted", output: null })],
    };
    const t = fromRunTree(interrupted);
    expect(t.status).toBe("failed");
    expect(findStep(t, 0, 0)?.status).toBe("failed");
    expect(findStep(t, 0, 1)?.status).toBe("waiting");
    expect(t.error).toBeNull();
  });

  it("keeps a stopped step's partial output, as stopped", () => {
    const stopped: RunTree = {
      ...tree,
      run: { ...tree.run, status: "cancelled", answer: null, error_kind: null, error: null },
      steps: [
        record(0, 0, 0, [], {}),
        record(0, 1, CONDUCTOR, "all", { status: "cancelled", output: "half an ans", error_kind: "cancelled" }),
        // As recorded before a stopped step had a status of its own.
        record(0, 2, 1, [1], { status: "failed", output: "a start", error_kind: "cancelled", error: "stopped" }),
      ],
    };
    const t = fromRunTree(stopped);
    expect(t.status).toBe("cancelled");
    expect(findStep(t, 0, 1)).toMatchObject({ status: "cancelled", output: "half an ans" });
    expect(findStep(t, 0, 2)).toMatchObject({ status: "cancelled", output: "a start" });
    expect(t.totals).toMatchObject({ steps_finished: [0], steps_failed: [1, 2] });
    const answer = graphOf(t).nodes.find((n) => n.id === ANSWER_ID)!;
    expect(nodeStatus(t, answer)).toBe("cancelled");
    const node = graphOf(t).nodes.find((n) => n.id === stepId(0, 2))!;
    expect(nodeStatus(t, node)).toBe("cancelled");
  });
});

describe("a stopped run, live", () => {
  it("keeps what a stopped step streamed, or the partial output its event carries", () => {
    const t = fold([
      started(),
      { type: "plan_ready", round: 0, depth: 0, plan: plan([[0, []], [1, []]]) },
      { type: "step_started", round: 0, step: 0, worker: 0, system: null, messages: [] },
      { type: "step_started", round: 0, step: 1, worker: 1, system: null, messages: [] },
      { type: "step_delta", round: 0, step: 0, text: "partial " },
      { type: "step_delta", round: 0, step: 0, text: "text" },
      { type: "step_delta", round: 0, step: 1, text: "so" },
      { type: "step_failed", round: 0, step: 0, error: { kind: "cancelled", message: "stopped" } },
      {
        type: "step_failed",
        round: 0,
        step: 1,
        error: { kind: "cancelled", message: "stopped" },
        output: "so far",
      } as RunEvent,
      { type: "run_cancelled", totals: TOTALS },
    ]);
    expect(findStep(t, 0, 0)).toMatchObject({ status: "cancelled", output: "partial text" });
    expect(findStep(t, 0, 1)).toMatchObject({ status: "cancelled", output: "so far" });
    expect(t.status).toBe("cancelled");
    // A step that failed for another reason is still failed.
    applyEvent(t, { type: "step_failed", round: 0, step: 1, error: { kind: "timeout", message: "slow" } });
    expect(findStep(t, 0, 1)?.status).toBe("failed");
  });

  it("shows a plan stopped while it was being written as stopped, not failed", () => {
    const t = fold([started(), { type: "plan_started", round: 0, depth: 0 }, { type: "run_cancelled", totals: TOTALS }]);
    expect(nodeStatus(t, graphOf(t).nodes[0])).toBe("cancelled");
  });
});

// ---- Layout ---------------------------------------------------------------------------------

function overlaps(a: { x: number; y: number; width: number; height: number }, b: typeof a): boolean {
  return a.x < b.x + b.width && b.x < a.x + a.width && a.y < b.y + b.height && b.y < a.y + a.height;
}

function contains(outer: { x: number; y: number; width: number; height: number }, inner: typeof outer): boolean {
  return (
    inner.x >= outer.x - 0.5 &&
    inner.y >= outer.y - 0.5 &&
    inner.x + inner.width <= outer.x + outer.width + 0.5 &&
    inner.y + inner.height <= outer.y + outer.height + 0.5
  );
}

/** Checks every geometric promise the drawing relies on. */
function expectSound(g: TopologyGraph, l: TopologyLayout): void {
  expect(l.nodes.map((n) => n.id)).toEqual(g.nodes.map((n) => n.id));
  expect(l.edges.length).toBe(g.edges.length);
  for (let i = 0; i < l.nodes.length; i++) {
    const a = l.nodes[i];
    expect(Number.isFinite(a.x) && Number.isFinite(a.y)).toBe(true);
    expect(contains({ x: 0, y: 0, width: l.width, height: l.height }, a)).toBe(true);
    for (let j = i + 1; j < l.nodes.length; j++) {
      expect(overlaps(a, l.nodes[j]), `${a.id} overlaps ${l.nodes[j].id}`).toBe(false);
    }
    const cluster = l.clusters.find((c) => c.id === a.cluster);
    if (cluster) expect(contains(cluster, a), `${a.id} is outside ${cluster.id}`).toBe(true);
  }
  for (const e of l.edges) {
    expect(e.points.length).toBeGreaterThanOrEqual(2);
    for (const p of e.points) expect(Number.isFinite(p.x) && Number.isFinite(p.y)).toBe(true);
  }
  for (const c of l.clusters) {
    const parent = l.clusters.find((p) => p.id === c.parent);
    if (parent) expect(contains(parent, c), `${c.id} is outside ${parent.id}`).toBe(true);
  }
}

/** A deterministic pseudo-random source, so a failing case can be replayed. */
function rng(seed: number): () => number {
  return () => {
    seed = (seed * 1103515245 + 12345) % 2147483648;
    return seed / 2147483648;
  };
}

/** A run of random five-step-at-most plans, recursing where a step goes to the conductor. */
function randomRun(seed: number, maxRounds: number): Topology {
  const rand = rng(seed);
  const events: RunEvent[] = [started()];
  const pending: Array<{ depth: number; parent?: { round: number; step: number } }> = [{ depth: 0 }];
  for (let round = 0; round < maxRounds && pending.length > 0; round++) {
    const { depth, parent } = pending.shift()!;
    const n = 1 + Math.floor(rand() * 5);
    const steps: Array<[number, Access]> = [];
    for (let i = 0; i < n; i++) {
      const toConductor = round + pending.length + 1 < maxRounds && rand() < 0.25;
      const worker = toConductor ? CONDUCTOR : Math.floor(rand() * WORKERS.length);
      const r = rand();
      const access: Access = r < 0.3 ? "all" : r < 0.5 ? [] : [...Array(i).keys()].filter(() => rand() < 0.5);
      steps.push([worker, access]);
      if (toConductor) pending.push({ depth: depth + 1, parent: { round, step: i } });
    }
    events.push(...roundEvents(round, plan(steps), depth, parent));
  }
  return fold(events);
}

describe("layout", () => {
  it("lays out a small run without overlaps", () => {
    const g = graphOf(fold([started(), ...roundEvents(0, plan([[0, []], [1, "all"], [2, [0]]]))]));
    const l = layout(g);
    expectSound(g, l);
    // Top to bottom: the plan above its steps, the answer below the last one.
    const y = (id: string) => l.nodes.find((n) => n.id === id)!.y;
    expect(y("r0plan")).toBeLessThan(y("r0s0"));
    expect(y("r0s0")).toBeLessThan(y("r0s1"));
    expect(y("r0s2")).toBeLessThan(y(ANSWER_ID));
  });

  it("routes edges from the bottom middle of one box to the top middle of the next", () => {
    const g = graphOf(fold([started(), ...roundEvents(0, plan([[0, []], [1, []], [2, [0, 1]], [0, [0, 2]]]))]));
    const l = layout(g);
    const node = (id: string) => l.nodes.find((n) => n.id === id)!;
    for (const e of l.edges) {
      const [from, to] = [node(e.from), node(e.to)];
      expect(e.points[0]).toEqual({ x: from.x + from.width / 2, y: from.y + from.height });
      expect(e.points[e.points.length - 1]).toEqual({ x: to.x + to.width / 2, y: to.y });
    }
    // Neighbouring layers are joined directly; r0s0 -> r0s3 passes r0s2's layer, so it bends.
    const edge = (from: string, to: string) => l.edges.find((e) => e.from === from && e.to === to)!;
    expect(edge("r0s2", "r0s3").points).toHaveLength(2);
    expect(edge("r0s0", "r0s3").points.length).toBeGreaterThan(2);
  });

  it("lays out an empty run as nothing", () => {
    const l = layout(graphOf(emptyTopology()));
    expect(l.nodes).toEqual([]);
    expect(l.edges).toEqual([]);
    expect(Number.isFinite(l.width) && Number.isFinite(l.height)).toBe(true);
  });

  it("puts a nested round inside the round that opened it", () => {
    const t = fold([
      started(),
      { type: "plan_ready", round: 0, depth: 0, plan: plan([[0, []], [CONDUCTOR, "all"], [1, [1]]]) },
      { type: "plan_ready", round: 1, depth: 1, parent: { round: 0, step: 1 }, plan: plan([[2, []], [0, "all"]]) },
    ]);
    const g = graphOf(t);
    const l = layout(g);
    expectSound(g, l);
    const box = (id: string) => l.clusters.find((c) => c.id === id)!;
    expect(contains(box("round0"), box("round1"))).toBe(true);
  });

  it("lays out a graph of more than 50 nodes", () => {
    const t = randomRun(7, 14);
    const g = graphOf(t);
    expect(g.nodes.length).toBeGreaterThan(50);
    expect(g.clusters.some((c) => c.depth >= 2)).toBe(true);
    expectSound(g, layout(g));
  });

  it("lays out many random runs soundly", () => {
    for (let seed = 1; seed <= 40; seed++) {
      const g = graphOf(randomRun(seed, 1 + (seed % 8)));
      expectSound(g, layout(g));
    }
  });
});

describe("re-runs", () => {
  it("re-runs a step with every step that sees it, directly or through others", () => {
    // 0 ← 1 ← 3, 2 sees nothing, 4 sees everything.
    const p = plan([[0, []], [0, [0]], [1, []], [1, [1]], [2, "all"]]);
    expect(rerunSteps(p, 0)).toEqual([0, 1, 3, 4]);
    expect(rerunSteps(p, 2)).toEqual([2, 4]);
    expect(rerunSteps(p, 4)).toEqual([4]);
  });

  it("also re-runs the steps that did not finish, and the steps that see them", () => {
    const p = plan([[0, []], [0, []], [1, [1]], [1, []]]);
    // Step 1 failed the first time, so step 2 never ran; re-running step 3 runs all three.
    expect(rerunSteps(p, 3, [true, false, false, true])).toEqual([1, 2, 3]);
  });

  // Step 1 of run-0 again with gamma: step 0 is kept, step 2 (sees 1) runs again.
  const p = plan([[0, []], [2, [0]], [1, [1]]]);
  const rerunOf = { run_id: "run-0", step: 1 };
  const finished = (step: number): RunEvent => ({
    type: "step_finished",
    round: 0,
    step,
    output: `new ${step}`,
    usage: { input_tokens: 3, output_tokens: 2, cached_input_tokens: 0, cache_write_input_tokens: 0 },
    cost_usd: 0,
    latency_ms: 50,
    retries: 0,
  });
  const events: RunEvent[] = [
    { ...started(), rerun_of: rerunOf } as RunEvent,
    { type: "plan_ready", round: 0, depth: 0, plan: p },
    { type: "step_reused", round: 0, step: 0, worker: 0, output: "old 0", from_run: "run-0" },
    { type: "step_started", round: 0, step: 1, worker: 2, system: null, messages: [] },
    finished(1),
    { type: "step_started", round: 0, step: 2, worker: 1, system: null, messages: [] },
    finished(2),
    { type: "run_finished", answer: "new 2", totals: { ...TOTALS, calls: 2 } },
  ];

  it("shows kept steps as done, with where their output came from", () => {
    const t = fold(events);
    expect(t.rerun_of).toEqual(rerunOf);
    expect(findStep(t, 0, 0)).toMatchObject({ status: "done", output: "old 0", reused_from: "run-0", request: null });
    expect(findStep(t, 0, 1)).toMatchObject({ status: "done", worker_name: "gamma", reused_from: null });
  });

  it("reads a stored re-run as the live events built it", () => {
    const step = (i: number, worker: number, access: Access, extra: Partial<StepRecord>): StepRecord => ({
      round: 0,
      step: i,
      worker_index: worker,
      worker: WORKERS[worker].name,
      subtask: `subtask ${i}`,
      access,
      request: { system: null, messages: [] },
      status: "finished",
      output: `new ${i}`,
      error_kind: null,
      error: null,
      input_tokens: 3,
      cached_input_tokens: 0,
      cache_write_input_tokens: 0,
      output_tokens: 2,
      cost_usd: 0,
      latency_ms: 50,
      retries: 0,
      reused_from: null,
      ...extra,
    });
    const tree: RunTree = {
      run: {
        id: 2,
        uid: "run-1",
        conversation_id: 1,
        question: "q?",
        conductor: null,
        workers: WORKERS,
        status: "finished",
        answer: "new 2",
        error_kind: null,
        error: null,
        started_at: 0,
        finished_at: 1,
        rounds: 1,
        calls: 2,
        input_tokens: 6,
        output_tokens: 4,
        cost_usd: 0,
        cost_complete: true,
        totals: null,
        wall_ms: 100,
        rerun_of: rerunOf,
      },
      plans: [{ round: 0, depth: 0, parent: null, raw: null, plan: p, usage: null, stop_reason: null, prompt: null, rejected: [], fallback: null }],
      steps: [
        step(0, 0, [], {
          output: "old 0",
          request: null,
          input_tokens: null,
          output_tokens: null,
          cost_usd: null,
          latency_ms: null,
          reused_from: "run-0",
        }),
        step(1, 2, [0], {}),
        step(2, 1, [1], {}),
      ],
      events: [],
    };
    const stored = fromRunTree(tree);
    const live = fold(events);
    expect(stored.rerun_of).toEqual(live.rerun_of);
    expect(stored.rounds[0].steps).toEqual(live.rounds[0].steps);
    expect(graphOf(stored)).toEqual(graphOf(live));
  });
});
