// The editable form of a plan on the plan review screen, and its validation.
//
// The rules mirror `Plan::validate` in crates/baton-plan (same messages, same 0-based step
// numbers) so that a plan this module accepts is one the backend accepts. Unlike the backend,
// which stops at the first problem, `validate` reports every problem so the editor can mark all
// offending fields at once.

import type { Access, Plan } from "../bindings";

export type EditStep = {
  /** Index of the worker in the pool. */
  worker: number;
  /** The instruction the worker receives. */
  subtask: string;
  /** "all" = every earlier step; otherwise exactly these earlier steps ([] = none). */
  access: "all" | number[];
};

export type PlanProblem = {
  /** The offending step, or null for a problem with the plan as a whole. */
  step: number | null;
  field: "worker" | "subtask" | "access" | null;
  message: string;
};

export type Validation = { ok: boolean; errors: PlanProblem[] };

/** Splits a plan's three parallel lists into steps (copies, so edits never touch `plan`). */
export function fromPlan(plan: Plan): EditStep[] {
  return plan.model_id.map((worker, i) => ({
    worker,
    subtask: plan.subtasks[i],
    access: copyAccess(plan.access_list[i]),
  }));
}

/** Zips steps back into the three lists, with access lists sorted and deduplicated. */
export function toPlan(steps: EditStep[]): Plan {
  return {
    model_id: steps.map((s) => s.worker),
    subtasks: steps.map((s) => s.subtask),
    access_list: steps.map((s) => (s.access === "all" ? "all" : normalize(s.access))),
  };
}

/** Checks `steps` against the pool and the step cap; `ok` iff `errors` is empty. */
export function validate(steps: EditStep[], opts: { poolSize: number; maxSteps: number }): Validation {
  const errors: PlanProblem[] = [];
  const plan = (message: string) => errors.push({ step: null, field: null, message });

  if (steps.length === 0) plan("the plan has no steps");
  if (steps.length > opts.maxSteps) {
    plan(`the plan has ${steps.length} steps; at most ${opts.maxSteps} are allowed`);
  }

  steps.forEach((step, i) => {
    const workerProblem = checkWorker(step.worker, opts.poolSize);
    if (workerProblem) errors.push({ step: i, field: "worker", message: workerProblem });

    if (step.subtask.trim() === "") errors.push({ step: i, field: "subtask", message: "the subtask is empty" });

    if (step.access !== "all") {
      for (const j of normalize(step.access)) {
        const message = checkAccess(i, j);
        if (message) errors.push({ step: i, field: "access", message });
      }
    }
  });

  return { ok: errors.length === 0, errors };
}

function checkWorker(worker: number, poolSize: number): string | null {
  if (Number.isInteger(worker) && worker >= 0 && worker < poolSize) return null;
  // In recursive runs the conductor is "Model <poolSize>"; a reviewed plan runs as it stands,
  // with no nested round for the conductor to plan.
  if (worker === poolSize) return `model ${worker} is the conductor, which cannot take a step of a reviewed plan`;
  const range =
    poolSize === 0
      ? "the pool is empty"
      : `the pool has ${poolSize} worker${poolSize === 1 ? "" : "s"} (0..=${poolSize - 1})`;
  return `model ${worker} is not in the pool; ${range}`;
}

function checkAccess(i: number, j: number): string | null {
  if (!Number.isInteger(j) || j < 0) return `${j} is not a step number`;
  if (j === i) return `step ${i} cannot see its own output; a step sees only earlier steps`;
  if (j > i) return `step ${j} comes after step ${i}; a step sees only earlier steps`;
  return null;
}

/**
 * Removes step `index`. Access lists stay pointed at the same steps: references to the removed
 * step are dropped and references to later steps move down by one.
 */
export function removeStep(steps: EditStep[], index: number): EditStep[] {
  return renumber(
    steps.filter((_, i) => i !== index),
    (j) => (j === index ? null : j > index ? j - 1 : j),
  );
}

/**
 * Inserts `step` at `index` (0..=steps.length). References to steps at or after `index` move up
 * by one; `step.access` is taken as given, in the new numbering.
 */
export function insertStep(steps: EditStep[], index: number, step: EditStep): EditStep[] {
  const shifted = renumber(steps, (j) => (j >= index ? j + 1 : j));
  return [...shifted.slice(0, index), { ...step, access: copyAccess(step.access) }, ...shifted.slice(index)];
}

/** Rewrites every explicit access list through `map` (null drops the reference). */
function renumber(steps: EditStep[], map: (j: number) => number | null): EditStep[] {
  return steps.map((s) => ({
    ...s,
    access: s.access === "all" ? "all" : s.access.map(map).filter((j) => j !== null),
  }));
}

function normalize(indices: number[]): number[] {
  return [...new Set(indices)].sort((a, b) => a - b);
}

function copyAccess(access: Access): "all" | number[] {
  return access === "all" ? "all" : [...access];
}
