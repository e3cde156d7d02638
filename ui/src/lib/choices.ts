// A conversation's choice of workers is shown and sent as pool numbers, but numbers change
// when the pool file is edited; names do not. These find the same workers again by name.

export interface Named {
  index: number;
  name: string;
}

export interface Choice {
  /** Pool numbers; null for every worker. */
  workers: number[] | null;
  /** Chosen workers that are not in the pool now (kept, so saving does not drop them). */
  missing: string[];
}

/** The choice made in the pool `before`, in the pool as it is `now`. */
export function rechoose(choice: Choice, before: Named[], now: Named[]): Choice {
  const chosen = choice.workers;
  if (chosen === null) return choice;
  const names = [...before.filter((w) => chosen.includes(w.index)).map((w) => w.name), ...choice.missing];
  return {
    workers: now.filter((w) => names.includes(w.name)).map((w) => w.index),
    missing: names.filter((name) => !now.some((w) => w.name === name)),
  };
}

/** The pool numbers of the workers `named`, in that order, and the names the pool lacks. */
export function byName(named: string[], pool: Named[]): { indices: number[]; gone: string[] } {
  const found = named.map((name) => pool.find((w) => w.name === name)?.index);
  return {
    indices: found.filter((i): i is number => i !== undefined),
    gone: named.filter((_, i) => found[i] === undefined),
  };
}
