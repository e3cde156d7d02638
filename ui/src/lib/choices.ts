// A conversation's choice of workers is shown and sent as pool numbers, but numbers change
// when the pool file is edited; names do not. The history keeps names; these translate.

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

/** The names of the workers numbered `indices` in `pool`. */
export function namesOf(indices: number[], pool: Named[]): string[] {
  return pool.filter((w) => indices.includes(w.index)).map((w) => w.name);
}

/**
 * The workers `named`, as numbers in `pool` (in pool order) and the names it lacks. Possibly
 * none, when every one has left the pool: asking then says to choose again, rather than
 * quietly widening the choice to every worker.
 */
export function choiceOf(named: string[], pool: Named[]): Choice {
  return {
    workers: pool.filter((w) => named.includes(w.name)).map((w) => w.index),
    missing: named.filter((name) => !pool.some((w) => w.name === name)),
  };
}

/** The choice made in the pool `before`, in the pool as it is `now`. */
export function rechoose(choice: Choice, before: Named[], now: Named[]): Choice {
  if (choice.workers === null) return choice;
  return choiceOf([...namesOf(choice.workers, before), ...choice.missing], now);
}

/** The pool numbers of the workers `named`, in that order, and the names the pool lacks. */
export function byName(named: string[], pool: Named[]): { indices: number[]; gone: string[] } {
  const found = named.map((name) => pool.find((w) => w.name === name)?.index);
  return {
    indices: found.filter((i): i is number => i !== undefined),
    gone: named.filter((_, i) => found[i] === undefined),
  };
}
