import { describe, expect, it } from "vitest";
import { byName, choiceOf, namesOf, rechoose } from "./choices";

const pool = (...names: string[]) => names.map((name, index) => ({ index, name }));

describe("rechoose", () => {
  it("follows the chosen workers to their new numbers", () => {
    // B was chosen; A is removed, so B is now number 0 and C number 1.
    expect(rechoose({ workers: [1], missing: [] }, pool("A", "B", "C"), pool("B", "C"))).toEqual({
      workers: [0],
      missing: [],
    });
  });

  it("keeps a worker that left as missing, and takes it back when it returns", () => {
    const left = rechoose({ workers: [0, 2], missing: [] }, pool("A", "B", "C"), pool("B", "C"));
    expect(left).toEqual({ workers: [1], missing: ["A"] });
    expect(rechoose(left, pool("B", "C"), pool("C", "A", "B"))).toEqual({ workers: [0, 1], missing: [] });
  });

  it("leaves 'every worker' as it is", () => {
    const all = { workers: null, missing: [] };
    expect(rechoose(all, pool("A"), pool("B", "A"))).toBe(all);
  });

  it("may end with none chosen, rather than widening to all", () => {
    expect(rechoose({ workers: [0], missing: [] }, pool("A", "B"), pool("B"))).toEqual({ workers: [], missing: ["A"] });
  });
});

describe("byName", () => {
  it("gives numbers in the order named, not pool order", () => {
    expect(byName(["C", "A"], pool("A", "B", "C"))).toEqual({ indices: [2, 0], gone: [] });
  });

  it("names the workers the pool lacks", () => {
    expect(byName(["A", "Z"], pool("A", "B"))).toEqual({ indices: [0], gone: ["Z"] });
  });
});

describe("choiceOf and namesOf", () => {
  it("turn names into numbers in pool order, keeping the names the pool lacks", () => {
    expect(choiceOf(["C", "Z", "A"], pool("A", "B", "C"))).toEqual({ workers: [0, 2], missing: ["Z"] });
    expect(namesOf([2, 0], pool("A", "B", "C"))).toEqual(["A", "C"]);
  });
});
