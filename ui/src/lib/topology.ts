// The topology of one run: which rounds the conductor planned, which steps ran on which worker,
// and how far each got. Built live from RunEvents (`applyEvent`) or from a stored run
// (`fromRunTree`), then turned into a drawable graph (`graphOf`) and laid out (`layout`).
// Pure logic: no DOM, so it is tested directly.

import dagre, { type EdgeLabel, type GraphLabel, type NodeLabel } from "@dagrejs/dagre";
import type {
  Access,
  Plan,
  RerunOf,
  RunError,
  RunEvent,
  RunStatus,
  RunTree,
  SentRequest,
  StepRef,
  StepRecord,
  Totals,
  Usage,
  WorkerInfo,
} from "../bindings";

/** "cancelled": stopped by the user before it finished; its output is the text it had so far. */
export type StepStatus = "waiting" | "running" | "done" | "failed" | "cancelled";
export type RoundStatus = "planning" | "ready";
/** "idle" only before run_started; a stored run that was interrupted reads as "failed". */
export type RunState = "idle" | "running" | "finished" | "failed" | "cancelled";

export interface TopologyStep {
  round: number;
  step: number;
  /** Index in the pool; `workers.length` means the conductor itself (a nested round). */
  worker: number;
  worker_name: string;
  subtask: string;
  /** Earlier steps of the same round this step sees, resolved ("all" is every earlier step). */
  access: number[];
  status: StepStatus;
  /** Text streamed so far; the whole answer once done. */
  output: string;
  usage: Usage | null;
  /** Null while unknown: not finished yet, or the worker's price is unknown. */
  cost_usd: number | null;
  latency_ms: number | null;
  retries: number;
  error: { kind: string; message: string } | null;
  /** Exactly what the worker was sent (from step_started). */
  request: SentRequest | null;
  /** In a re-run, for a step that kept its earlier output: the run it comes from. */
  reused_from: string | null;
}

export interface TopologyRound {
  round: number;
  depth: number;
  /** The step that handed work back to the conductor; null for the top round. */
  parent: StepRef | null;
  plan: Plan | null;
  /** The conductor's text: streamed while planning, whole once ready; null for a given plan. */
  raw: string | null;
  /** The conductor's attempts that could not be used, and why (the last streamed text moves here). */
  rejected: { reason: string; raw: string | null }[];
  /** Why this round's plan is one worker alone instead of the conductor's; null when it is not. */
  fallback: string | null;
  status: RoundStatus;
  /** Indexed by step number. */
  steps: TopologyStep[];
}

// Plain objects and arrays only (no Map/Set), so a Svelte `$state` proxy tracks every field.
export interface Topology {
  run_id: string | null;
  question: string;
  workers: WorkerInfo[];
  conductor: string | null;
  /** Set when this run re-runs one step of an earlier run with another worker. */
  rerun_of: RerunOf | null;
  /** Sorted by round number. */
  rounds: TopologyRound[];
  status: RunState;
  answer: string | null;
  error: RunError | null;
  totals: Totals | null;
}

export function emptyTopology(): Topology {
  return {
    run_id: null,
    question: "",
    workers: [],
    conductor: null,
    rerun_of: null,
    rounds: [],
    status: "idle",
    answer: null,
    error: null,
    totals: null,
  };
}

export function findRound(t: Topology, round: number): TopologyRound | undefined {
  return t.rounds.find((r) => r.round === round);
}

export function findStep(t: Topology, round: number, step: number): TopologyStep | undefined {
  return findRound(t, round)?.steps[step];
}

/** Mirrors the history recorder's naming, so live and stored runs agree. */
export function workerName(workers: WorkerInfo[], index: number): string {
  if (index < workers.length) return workers[index].name;
  return index === workers.length ? "conductor" : `worker ${index}`;
}

/** Earlier step indices a step sees. Only earlier ones are kept, so the drawing stays acyclic. */
export function resolveAccess(access: Access, step: number): number[] {
  if (access === "all") return Array.from({ length: step }, (_, j) => j);
  return [...new Set(access)].filter((j) => j >= 0 && j < step).sort((a, b) => a - b);
}

function ensureRound(t: Topology, round: number, depth: number, parent: StepRef | null): TopologyRound {
  let r = findRound(t, round);
  if (!r) {
    r = { round, depth, parent, plan: null, raw: null, rejected: [], fallback: null, status: "planning", steps: [] };
    // Rounds arrive in order, so this is almost always a push.
    const at = t.rounds.findIndex((other) => other.round > round);
    if (at < 0) t.rounds.push(r);
    else t.rounds.splice(at, 0, r);
  }
  return r;
}

function planSteps(t: Topology, round: number, plan: Plan): TopologyStep[] {
  return plan.subtasks.map((subtask, i) => {
    const worker = plan.model_id[i];
    return {
      round,
      step: i,
      worker,
      worker_name: workerName(t.workers, worker),
      subtask,
      access: resolveAccess(plan.access_list[i] ?? [], i),
      status: "waiting",
      output: "",
      usage: null,
      cost_usd: null,
      latency_ms: null,
      retries: 0,
      error: null,
      request: null,
      reused_from: null,
    };
  });
}

/**
 * Folds one event into the topology, in place (the same object is returned). Events for
 * unknown rounds or steps are ignored rather than thrown on: a view must survive a gap.
 */
export function applyEvent(t: Topology, e: RunEvent): Topology {
  switch (e.type) {
    case "run_started":
      // A new run replaces whatever this topology showed before.
      Object.assign(t, emptyTopology(), {
        run_id: e.run_id,
        question: e.question,
        workers: e.workers,
        conductor: e.conductor ?? null,
        rerun_of: e.rerun_of ?? null,
        status: "running",
      });
      break;
    case "plan_started":
      ensureRound(t, e.round, e.depth, e.parent ?? null);
      break;
    case "plan_delta": {
      const r = findRound(t, e.round);
      if (r) r.raw = (r.raw ?? "") + e.text;
      break;
    }
    case "plan_rejected": {
      // The next attempt (or the fallback) starts its text afresh; this one is kept with its reason.
      const r = findRound(t, e.round);
      if (!r) break;
      r.rejected.push({ reason: e.reason, raw: e.raw ?? r.raw });
      r.raw = null;
      break;
    }
    case "plan_ready": {
      // A plan given up front has no plan_started, so the round may be new here.
      const r = ensureRound(t, e.round, e.depth, e.parent ?? null);
      r.depth = e.depth;
      r.parent = e.parent ?? null;
      r.plan = e.plan;
      r.raw = e.raw ?? r.raw;
      r.fallback = e.fallback ?? null;
      r.status = "ready";
      r.steps = planSteps(t, e.round, e.plan);
      break;
    }
    case "step_started": {
      const s = findStep(t, e.round, e.step);
      if (!s) break;
      s.status = "running";
      s.worker = e.worker;
      s.worker_name = workerName(t.workers, e.worker);
      s.request = { system: e.system, messages: e.messages };
      s.output = "";
      break;
    }
    case "step_delta": {
      const s = findStep(t, e.round, e.step);
      if (s) s.output += e.text;
      break;
    }
    case "step_retrying": {
      const s = findStep(t, e.round, e.step);
      if (!s) break;
      // The failed attempt's text is void; `attempt` counts failed attempts, like the history.
      s.output = "";
      s.retries = e.attempt;
      break;
    }
    case "step_finished": {
      const s = findStep(t, e.round, e.step);
      if (!s) break;
      s.status = "done";
      s.output = e.output;
      s.usage = e.usage;
      s.cost_usd = e.cost_usd ?? null;
      s.latency_ms = e.latency_ms;
      s.retries = e.retries;
      s.error = null;
      break;
    }
    case "step_reused": {
      // A re-run keeps this step's earlier output; nothing was called.
      const s = findStep(t, e.round, e.step);
      if (!s) break;
      s.status = "done";
      s.worker = e.worker;
      s.worker_name = workerName(t.workers, e.worker);
      s.output = e.output;
      s.reused_from = e.from_run;
      break;
    }
    case "step_failed": {
      // May come for a step that never started (a dependency failed, or the run stopped). A
      // stopped step keeps the text it streamed, or the partial output the event carries.
      const s = findStep(t, e.round, e.step);
      if (!s) break;
      s.status = e.error.kind === "cancelled" ? "cancelled" : "failed";
      s.error = { kind: e.error.kind, message: e.error.message };
      const partial = (e as { output?: string | null }).output;
      if (typeof partial === "string" && partial.length >= s.output.length) s.output = partial;
      break;
    }
    case "run_finished":
      t.status = "finished";
      t.answer = e.answer;
      t.totals = e.totals;
      break;
    case "run_failed":
      t.status = "failed";
      t.error = e.error;
      t.totals = e.totals;
      break;
    case "run_cancelled":
      t.status = "cancelled";
      t.totals = e.totals;
      break;
  }
  return t;
}

const STORED_STEP_STATUS: Record<string, StepStatus> = {
  running: "running",
  finished: "done",
  failed: "failed",
  cancelled: "cancelled",
  interrupted: "failed",
};

const STORED_RUN_STATUS: Record<RunStatus, RunState> = {
  running: "running",
  finished: "finished",
  failed: "failed",
  cancelled: "cancelled",
  interrupted: "failed",
};

function overlayStoredStep(s: TopologyStep, rec: StepRecord, workers: WorkerInfo[]): void {
  s.worker = rec.worker_index;
  s.worker_name = rec.worker || workerName(workers, rec.worker_index);
  s.subtask = rec.subtask;
  s.access = resolveAccess(rec.access, rec.step);
  s.status = STORED_STEP_STATUS[rec.status] ?? "waiting";
  // Recorded before stopped steps had a status of their own: a failure of kind "cancelled".
  if (s.status === "failed" && rec.error_kind === "cancelled") s.status = "cancelled";
  s.output = rec.output ?? "";
  s.usage =
    rec.input_tokens === null && rec.output_tokens === null
      ? null
      : {
          input_tokens: rec.input_tokens ?? 0,
          output_tokens: rec.output_tokens ?? 0,
          cached_input_tokens: rec.cached_input_tokens ?? 0,
          cache_write_input_tokens: rec.cache_write_input_tokens ?? 0,
        };
  s.cost_usd = rec.cost_usd;
  s.latency_ms = rec.latency_ms;
  s.retries = rec.retries;
  s.error = rec.error_kind || rec.error ? { kind: rec.error_kind ?? "", message: rec.error ?? "" } : null;
  s.request = rec.request;
  s.reused_from = rec.reused_from;
}

/** The same model as the live events would have built, from a run in the history. */
export function fromRunTree(tree: RunTree): Topology {
  const { run } = tree;
  // Replaying the start and the plans as events keeps one code path for rounds and steps.
  const t = applyEvent(emptyTopology(), {
    type: "run_started",
    run_id: run.uid,
    question: run.question,
    workers: run.workers,
    conductor: run.conductor ?? undefined,
    rerun_of: run.rerun_of ?? undefined,
  });
  for (const p of [...tree.plans].sort((a, b) => a.round - b.round)) {
    if (p.rejected && p.rejected.length > 0) {
      // Rejected attempts only happen while the conductor writes: the round exists before them.
      ensureRound(t, p.round, p.depth, p.parent ?? null);
      for (const r of p.rejected) {
        applyEvent(t, { type: "plan_rejected", round: p.round, reason: r.reason, raw: r.raw ?? undefined, retry: false });
      }
    }
    applyEvent(t, {
      type: "plan_ready",
      round: p.round,
      depth: p.depth,
      parent: p.parent ?? undefined,
      plan: p.plan,
      raw: p.raw ?? undefined,
      fallback: p.fallback ?? undefined,
    });
  }
  for (const rec of tree.steps) {
    const s = findStep(t, rec.round, rec.step);
    if (s) overlayStoredStep(s, rec, t.workers);
  }

  t.status = STORED_RUN_STATUS[run.status];
  t.answer = run.answer;
  t.error = run.error_kind || run.error ? ({ kind: run.error_kind ?? "", message: run.error ?? "" } as RunError) : null;
  const top = topRound(t);
  const topIndices = (status: StepStatus) => top?.steps.filter((s) => s.status === status).map((s) => s.step) ?? [];
  // As in the live totals: the round-0 steps that finished or failed.
  // A stopped step did not finish: the engine counts it with the failed ones.
  const failed = [...topIndices("failed"), ...topIndices("cancelled")].sort((a, b) => a - b);
  const steps = { steps_finished: topIndices("done"), steps_failed: failed };
  if (run.totals) {
    t.totals = { ...run.totals, ...steps };
  } else {
    // Recorded before the split by caller was kept: the whole run's figures, not split.
    const usage = { input_tokens: run.input_tokens, output_tokens: run.output_tokens, cached_input_tokens: 0, cache_write_input_tokens: 0 };
    const all = { calls: run.calls, usage, cost_usd: run.cost_usd, cost_complete: run.cost_complete };
    const none = { calls: 0, usage: { ...usage, input_tokens: 0, output_tokens: 0 }, cost_usd: 0, cost_complete: true };
    t.totals = { ...all, conductor: none, workers: all, cost_unknown_for: [], wall_ms: run.wall_ms ?? 0, rounds: run.rounds, ...steps };
  }
  return t;
}

/**
 * The steps that run again when `step` of `plan` is re-run: the step itself, every step that
 * did not finish the first time (`done[i]` false), and every step that sees one of those,
 * directly or through others. The rest keep their outputs. Mirrors the engine's
 * `rerun::prepare`.
 */
export function rerunSteps(plan: Plan, step: number, done: boolean[] = []): number[] {
  const again: number[] = [];
  // Steps only see earlier steps, so one pass in order reaches every dependent.
  for (let i = 0; i < plan.subtasks.length; i++) {
    const sees = resolveAccess(plan.access_list[i] ?? [], i);
    if (i === step || done[i] === false || sees.some((j) => again.includes(j))) again.push(i);
  }
  return again;
}

/** The round the question was planned in (its last step's output is the answer). */
export function topRound(t: Topology): TopologyRound | undefined {
  return t.rounds.find((r) => r.parent === null);
}

// ---- Graph ----------------------------------------------------------------------------------

export type NodeKind = "conductor" | "step" | "answer";
export type EdgeKind = "access" | "plan" | "answer" | "recursion";
/** What a node shows as its state; plan and answer nodes use the step vocabulary. */
export type NodeStatus = StepStatus;

export const ANSWER_ID = "answer";
export const stepId = (round: number, step: number): string => `r${round}s${step}`;
export const planId = (round: number): string => `r${round}plan`;
export const clusterId = (round: number): string => `round${round}`;

/** What a node id names, for whoever handles `onselect`. */
export type NodeTarget =
  | { kind: "step"; round: number; step: number }
  | { kind: "conductor"; round: number }
  | { kind: "answer" };

export function parseNodeId(id: string): NodeTarget | null {
  if (id === ANSWER_ID) return { kind: "answer" };
  const m = /^r(\d+)(?:s(\d+)|plan)$/.exec(id);
  if (!m) return null;
  const round = Number(m[1]);
  return m[2] === undefined ? { kind: "conductor", round } : { kind: "step", round, step: Number(m[2]) };
}

export interface GraphNode {
  id: string;
  kind: NodeKind;
  label: string;
  /** Worker name for steps, "conductor" for plan nodes, "" for the answer. */
  worker: string;
  round: number | null;
  step: number | null;
  /** The round cluster the node sits in; null for the answer. */
  cluster: string | null;
}

export interface GraphEdge {
  from: string;
  to: string;
  kind: EdgeKind;
}

export interface GraphCluster {
  id: string;
  round: number;
  depth: number;
  /** The enclosing round's cluster (nested rounds sit inside their parent step's round). */
  parent: string | null;
  label: string;
}

export interface TopologyGraph {
  nodes: GraphNode[];
  edges: GraphEdge[];
  clusters: GraphCluster[];
}

/** Nodes, edges and round clusters to draw; depends only on structure, not on progress. */
export function graphOf(t: Topology): TopologyGraph {
  const nodes: GraphNode[] = [];
  const edges: GraphEdge[] = [];
  const clusters: GraphCluster[] = [];

  for (const r of t.rounds) {
    const cluster = clusterId(r.round);
    const plan = planId(r.round);
    const parentStep = r.parent && findStep(t, r.parent.round, r.parent.step);
    clusters.push({
      id: cluster,
      round: r.round,
      depth: r.depth,
      parent: parentStep ? clusterId(parentStep.round) : null,
      label: r.depth > 0 ? `Round ${r.round} · depth ${r.depth}` : `Round ${r.round}`,
    });
    nodes.push({
      id: plan,
      kind: "conductor",
      // A fallback's plan is not the conductor's: the node says so.
      label: r.fallback ? `Conductor (round ${r.round}) · fallback` : `Conductor (round ${r.round})`,
      worker: "conductor",
      round: r.round,
      step: null,
      cluster,
    });
    // The step given to the conductor leads into the round it opened.
    if (parentStep) edges.push({ from: stepId(parentStep.round, parentStep.step), to: plan, kind: "recursion" });

    for (const s of r.steps) {
      const id = stepId(r.round, s.step);
      const name = s.worker_name;
      nodes.push({ id, kind: "step", label: name, worker: name, round: r.round, step: s.step, cluster });
      // A step that sees nothing earlier starts from the plan itself.
      if (s.access.length === 0) edges.push({ from: plan, to: id, kind: "plan" });
      for (const j of s.access) edges.push({ from: stepId(r.round, j), to: id, kind: "access" });
    }
  }

  const top = topRound(t);
  const last = top?.steps[top.steps.length - 1];
  if (top && last) {
    nodes.push({ id: ANSWER_ID, kind: "answer", label: "Answer", worker: "", round: null, step: null, cluster: null });
    edges.push({ from: stepId(top.round, last.step), to: ANSWER_ID, kind: "answer" });
  }
  return { nodes, edges, clusters };
}

/** A string that changes exactly when the drawing's structure does; cheap to compare. */
export function graphKey(g: TopologyGraph): string {
  const nodes = g.nodes.map((n) => `${n.id}:${n.cluster}:${n.label}`).join(",");
  const edges = g.edges.map((e) => `${e.from}>${e.to}:${e.kind}`).join(",");
  const clusters = g.clusters.map((c) => `${c.id}<${c.parent}:${c.label}`).join(",");
  return `${nodes}|${edges}|${clusters}`;
}

/** A node's state for colouring: plan and answer nodes are mapped onto the step statuses. */
export function nodeStatus(t: Topology, node: GraphNode): NodeStatus {
  if (node.kind === "answer") {
    if (t.status === "finished") return "done";
    if (t.status === "cancelled") return "cancelled";
    return t.status === "failed" ? "failed" : "waiting";
  }
  if (node.round === null) return "waiting";
  const r = findRound(t, node.round);
  if (!r) return "waiting";
  if (node.kind === "step") return r.steps[node.step ?? -1]?.status ?? "waiting";
  if (r.status === "ready") return "done";
  // Planning stops for good when the run ends or the step that asked for the plan failed.
  const parent = r.parent && findStep(t, r.parent.round, r.parent.step);
  if (parent?.status === "failed") return "failed";
  if (t.status === "cancelled" || parent?.status === "cancelled") return "cancelled";
  return t.status === "finished" || t.status === "failed" ? "failed" : "running";
}

// ---- Layout ---------------------------------------------------------------------------------

export interface Size {
  width: number;
  height: number;
}
export interface Point {
  x: number;
  y: number;
}
export type NodeSizes = Record<NodeKind, Size>;

/** Room for the lines Topology.svelte draws: title and status, plus figures for steps. */
export const NODE_SIZES: NodeSizes = {
  conductor: { width: 220, height: 50 },
  step: { width: 220, height: 68 },
  answer: { width: 180, height: 50 },
};

/** Boxes are given by their top-left corner. */
export interface LaidNode extends GraphNode, Point, Size {}
export interface LaidEdge extends GraphEdge {
  points: Point[];
}
export interface LaidCluster extends GraphCluster, Point, Size {}
export interface TopologyLayout {
  nodes: LaidNode[];
  edges: LaidEdge[];
  clusters: LaidCluster[];
  width: number;
  height: number;
}

/**
 * Layered top-to-bottom layout. Rounds are dagre clusters, nested inside the cluster of the
 * round that opened them. Edges only ever join plain nodes: dagre fails on edges that touch a
 * cluster, which is why the recursion edge ends at the nested round's plan node.
 */
export function layout(graph: TopologyGraph, sizes: NodeSizes = NODE_SIZES): TopologyLayout {
  // dagre reports an infinite size for an empty graph.
  if (graph.nodes.length === 0) return { nodes: [], edges: [], clusters: [], width: 0, height: 0 };
  const g = new dagre.graphlib.Graph<GraphLabel, NodeLabel, EdgeLabel>({ compound: true });
  g.setGraph({ rankdir: "TB", nodesep: 28, ranksep: 44, marginx: 16, marginy: 16 });
  g.setDefaultEdgeLabel(() => ({}));

  for (const c of graph.clusters) g.setNode(c.id, { width: 0, height: 0 });
  for (const c of graph.clusters) if (c.parent) g.setParent(c.id, c.parent);
  for (const n of graph.nodes) {
    g.setNode(n.id, { ...sizes[n.kind] });
    if (n.cluster) g.setParent(n.id, n.cluster);
  }
  for (const e of graph.edges) g.setEdge(e.from, e.to);

  // Steps that share a layer keep their plan order, left to right.
  const constraints = [];
  for (let i = 1; i < graph.nodes.length; i++) {
    const [left, right] = [graph.nodes[i - 1], graph.nodes[i]];
    if (left.kind === "step" && right.kind === "step" && left.round === right.round) {
      constraints.push({ left: left.id, right: right.id });
    }
  }
  dagre.layout(g, { constraints });

  // dagre gives centres; SVG rects want corners.
  const box = (id: string) => {
    const l = g.node(id);
    return { x: (l.x ?? 0) - l.width / 2, y: (l.y ?? 0) - l.height / 2, width: l.width, height: l.height };
  };
  const nodes: LaidNode[] = graph.nodes.map((n) => ({ ...n, ...box(n.id) }));
  const byId = new Map(nodes.map((n) => [n.id, n]));
  const layers = [...new Set(nodes.map((n) => n.y + n.height / 2))];

  const edges = graph.edges.map((e): LaidEdge => {
    const from = byId.get(e.from)!;
    const to = byId.get(e.to)!;
    const fromY = from.y + from.height / 2;
    const toY = to.y + to.height / 2;
    // Between neighbouring layers dagre still bends the edge at an empty in-between rank (the
    // clusters add those), off to one side; a straight run reads better. Longer edges keep
    // dagre's bends, which steer around the nodes in the layers they cross.
    const crossesLayer = layers.some((y) => y > fromY && y < toY);
    const bends = crossesLayer ? (g.edge(e.from, e.to).points ?? []).slice(1, -1).map(({ x, y }) => ({ x, y })) : [];
    // Out of the bottom middle of one box, into the top middle of the next.
    const start = { x: from.x + from.width / 2, y: from.y + from.height };
    const end = { x: to.x + to.width / 2, y: to.y };
    return { ...e, points: [start, ...bends, end] };
  });

  const { width = 0, height = 0 } = g.graph();
  return { nodes, edges, clusters: graph.clusters.map((c) => ({ ...c, ...box(c.id) })), width, height };
}
