import { describe, expect, it } from "vitest";
import type { Plan } from "../bindings";
import { fromPlan, insertStep, removeStep, toPlan, validate, type EditStep } from "./planEditor";

const LIMITS = { poolSize: 3, maxSteps: 5 };

function step(worker: number, subtask: string, access: EditStep["access"]): EditStep {
  return { worker, subtask, access };
}

/** A valid four-step plan: 0 and 1 independent, 2 sees 0, 3 sees everything. */
function sample(): EditStep[] {
  return [step(0, "research", []), step(1, "draft", []), step(2, "check", [0]), step(0, "answer", "all")];
}

describe("fromPlan / toPlan", () => {
  const plan: Plan = {
    model_id: [0, 2, 1],
    subtasks: ["a", "b", "c"],
    access_list: [[], "all", [0, 1]],
  };

  it("splits the three lists into steps", () => {
    expect(fromPlan(plan)).toEqual([step(0, "a", []), step(2, "b", "all"), step(1, "c", [0, 1])]);
  });

  it("round-trips a plan unchanged", () => {
    expect(toPlan(fromPlan(plan))).toEqual(plan);
  });

  it("does not alias the plan's arrays", () => {
    const steps = fromPlan(plan);
    (steps[2].access as number[]).push(2);
    expect(plan.access_list[2]).toEqual([0, 1]);
  });

  it("sorts access lists and removes duplicates", () => {
    const out = toPlan([step(0, "a", []), step(0, "b", []), step(0, "c", [1, 0, 1, 0])]);
    expect(out.access_list).toEqual([[], [], [0, 1]]);
  });

  it("keeps subtasks verbatim", () => {
    expect(toPlan([step(0, "  spaced\n", "all")]).subtasks).toEqual(["  spaced\n"]);
  });

  it("turns no steps into three empty lists", () => {
    expect(toPlan([])).toEqual({ model_id: [], subtasks: [], access_list: [] });
  });
});

describe("validate", () => {
  it("accepts a valid plan", () => {
    expect(validate(sample(), LIMITS)).toEqual({ ok: true, errors: [] });
  });

  it("requires at least one step", () => {
    expect(validate([], LIMITS)).toEqual({
      ok: false,
      errors: [{ step: null, field: null, message: "the plan has no steps" }],
    });
  });

  it("allows exactly maxSteps steps and no more", () => {
    const five = Array.from({ length: 5 }, (_, i) => step(0, `s${i}`, "all"));
    expect(validate(five, LIMITS).ok).toBe(true);
    const six = [...five, step(0, "s5", "all")];
    expect(validate(six, LIMITS)).toEqual({
      ok: false,
      errors: [{ step: null, field: null, message: "the plan has 6 steps; at most 5 are allowed" }],
    });
  });

  it("requires the worker to be in the pool", () => {
    for (const worker of [0, 1, 2]) expect(validate([step(worker, "x", [])], LIMITS).ok).toBe(true);
    expect(validate([step(0, "x", []), step(7, "y", [])], LIMITS).errors).toEqual([
      { step: 1, field: "worker", message: "model 7 is not in the pool; the pool has 3 workers (0..=2)" },
    ]);
    for (const worker of [-1, 1.5, Number.NaN]) {
      expect(validate([step(worker, "x", [])], LIMITS).errors.map((e) => e.field)).toEqual(["worker"]);
    }
  });

  it("rejects the conductor as a worker", () => {
    const { ok, errors } = validate([step(3, "x", [])], LIMITS);
    expect(ok).toBe(false);
    expect(errors).toHaveLength(1);
    expect(errors[0]).toMatchObject({ step: 0, field: "worker" });
    expect(errors[0].message).toContain("conductor");
  });

  it("words pool errors for one worker and for an empty pool", () => {
    expect(validate([step(1, "x", [])], { poolSize: 1, maxSteps: 5 }).errors[0].message).toBe(
      "model 1 is the conductor, which cannot take a step of a reviewed plan",
    );
    expect(validate([step(2, "x", [])], { poolSize: 1, maxSteps: 5 }).errors[0].message).toBe(
      "model 2 is not in the pool; the pool has 1 worker (0..=0)",
    );
    expect(validate([step(1, "x", [])], { poolSize: 0, maxSteps: 5 }).errors[0].message).toBe(
      "model 1 is not in the pool; the pool is empty",
    );
  });

  it("requires a non-blank subtask", () => {
    for (const subtask of ["", "   ", "\n\t "]) {
      expect(validate([step(0, subtask, [])], LIMITS).errors).toEqual([
        { step: 0, field: "subtask", message: "the subtask is empty" },
      ]);
    }
    expect(validate([step(0, "  padded  ", [])], LIMITS).ok).toBe(true);
  });

  it("lets a step see only earlier steps", () => {
    expect(validate([step(0, "a", []), step(0, "b", [0]), step(0, "c", [0, 1])], LIMITS).ok).toBe(true);
    expect(validate([step(0, "a", []), step(0, "b", [1])], LIMITS).errors).toEqual([
      { step: 1, field: "access", message: "step 1 cannot see its own output; a step sees only earlier steps" },
    ]);
    expect(validate([step(0, "a", [1]), step(0, "b", [])], LIMITS).errors).toEqual([
      { step: 0, field: "access", message: "step 1 comes after step 0; a step sees only earlier steps" },
    ]);
    expect(validate([step(0, "a", [-1])], LIMITS).errors).toEqual([
      { step: 0, field: "access", message: "-1 is not a step number" },
    ]);
  });

  it("reports a duplicated bad reference once", () => {
    expect(validate([step(0, "a", [0, 0, 0])], LIMITS).errors).toHaveLength(1);
  });

  it("accepts \"all\" and [] for the first step, which sees nothing either way", () => {
    expect(validate([step(0, "a", "all")], LIMITS).ok).toBe(true);
    expect(validate([step(0, "a", [])], LIMITS).ok).toBe(true);
  });

  it("reports every problem, not just the first", () => {
    const steps = [step(9, " ", [0]), step(1, "ok", [1, 2])];
    expect(validate(steps, { poolSize: 3, maxSteps: 1 }).errors).toEqual([
      { step: null, field: null, message: "the plan has 2 steps; at most 1 are allowed" },
      { step: 0, field: "worker", message: "model 9 is not in the pool; the pool has 3 workers (0..=2)" },
      { step: 0, field: "subtask", message: "the subtask is empty" },
      { step: 0, field: "access", message: "step 0 cannot see its own output; a step sees only earlier steps" },
      { step: 1, field: "access", message: "step 1 cannot see its own output; a step sees only earlier steps" },
      { step: 1, field: "access", message: "step 2 comes after step 1; a step sees only earlier steps" },
    ]);
  });
});

describe("removeStep", () => {
  it("drops references to the removed step and shifts later ones down", () => {
    const steps = [step(0, "a", []), step(0, "b", [0]), step(0, "c", [0, 1]), step(0, "d", [1, 2]), step(0, "e", "all")];
    expect(removeStep(steps, 1)).toEqual([
      step(0, "a", []),
      step(0, "c", [0]),
      step(0, "d", [1]),
      step(0, "e", "all"),
    ]);
  });

  it("leaves a step that only saw the removed one seeing nothing", () => {
    expect(removeStep([step(0, "a", []), step(0, "b", [0])], 0)).toEqual([step(0, "b", [])]);
  });

  it("removes the last step without renumbering anything", () => {
    const steps = sample();
    expect(removeStep(steps, 3)).toEqual(steps.slice(0, 3));
  });

  it("keeps a valid plan valid", () => {
    for (let i = 0; i < 4; i++) expect(validate(removeStep(sample(), i), LIMITS).ok, `removing ${i}`).toBe(true);
  });

  it("does not modify its input", () => {
    const steps = sample();
    removeStep(steps, 0);
    expect(steps).toEqual(sample());
  });
});

describe("insertStep", () => {
  it("shifts references at or after the insertion point up", () => {
    const steps = [step(0, "a", []), step(0, "b", [0]), step(0, "c", [0, 1]), step(0, "d", "all")];
    expect(insertStep(steps, 1, step(2, "new", [0]))).toEqual([
      step(0, "a", []),
      step(2, "new", [0]),
      step(0, "b", [0]),
      step(0, "c", [0, 2]),
      step(0, "d", "all"),
    ]);
  });

  it("inserts at the front", () => {
    expect(insertStep([step(0, "a", []), step(0, "b", [0])], 0, step(1, "new", []))).toEqual([
      step(1, "new", []),
      step(0, "a", []),
      step(0, "b", [1]),
    ]);
  });

  it("appends at the end without renumbering anything", () => {
    const steps = sample();
    expect(insertStep(steps, 4, step(1, "new", [3]))).toEqual([...sample(), step(1, "new", [3])]);
  });

  it("is undone by removeStep", () => {
    for (let i = 0; i <= 4; i++) {
      const inserted = insertStep(sample(), i, step(1, "new", []));
      expect(validate(inserted, LIMITS).ok, `inserting at ${i}`).toBe(true);
      expect(removeStep(inserted, i)).toEqual(sample());
    }
  });

  it("does not alias the inserted step or modify its input", () => {
    const steps = sample();
    const added = step(1, "new", [0]);
    const out = insertStep(steps, 1, added);
    (added.access as number[]).push(5);
    expect(out[1].access).toEqual([0]);
    expect(steps).toEqual(sample());
  });
});
