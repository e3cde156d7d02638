// The chat's bookkeeping, apart from the view so that it can be tested: which conversation's
// turns are shown, where the run in flight belongs, and whose choices the composer shows and
// saves. The view keeps a `ChatView` in `$state` and hands it to `Chat`, which changes it in
// place (so every change is tracked); the tests hand it a plain object.

import type { AppError, ChatComparison, Preferred } from "../bindings";
import type { ConversationPrefs } from "../state.svelte";
import type { Topology } from "./topology";

export interface Turn {
  key: string;
  topology: Topology;
  live: boolean;
  /** The run's id in the history, once recorded. */
  runId: number | null;
  /** Compare in chat: the same question answered by one worker alone, shown beside this one. */
  compare?: CompareSide;
}

/** The worker-alone side of a compared turn, and the user's mark of the better answer. */
export interface CompareSide {
  worker: string;
  topology: Topology;
  runId: number | null;
  /** The comparison in the history, once recorded (what a mark is kept on). */
  comparisonId: number | null;
  preferred: Preferred | null;
}

/**
 * A conversation's recorded turns with each comparison's worker-alone run beside its
 * conductor run's turn instead of a turn of its own. A worker run whose conductor run is gone
 * (deleted) stays a turn of its own.
 */
export function pairTurns(turns: Turn[], comparisons: ChatComparison[]): Turn[] {
  const byRun = new Map(turns.filter((t) => t.runId !== null).map((t) => [t.runId as number, t]));
  const beside = new Set<number>();
  const paired = new Map<number, CompareSide>();
  for (const c of comparisons) {
    if (c.conductor_run === null || !byRun.has(c.conductor_run)) continue;
    const alone = c.single_run === null ? undefined : byRun.get(c.single_run);
    if (alone === undefined) continue;
    beside.add(alone.runId as number);
    paired.set(c.conductor_run, {
      worker: c.worker,
      topology: alone.topology,
      runId: alone.runId,
      comparisonId: c.id,
      preferred: c.preferred,
    });
  }
  return turns
    .filter((t) => t.runId === null || !beside.has(t.runId))
    .map((t) => {
      const compare = t.runId === null ? undefined : paired.get(t.runId);
      return compare ? { ...t, compare } : t;
    });
}

/** A conversation's id, or null for a new chat (which has none until its first run ends). */
export type ConversationKey = number | null;

/** The run in flight: its turn, where it was asked, and the choices it was asked with. */
export interface LiveRun {
  conversation: ConversationKey;
  turn: Turn;
  prefs: ConversationPrefs;
}

export interface ChatView {
  /** The conversation shown. */
  selected: ConversationKey;
  /** Turns read from the history, and the conversation they are of. */
  loaded: { conversation: ConversationKey; turns: Turn[] };
  live: LiveRun | null;
  /** The choices the composer shows; null while the conversation's are being read. */
  prefs: ConversationPrefs | null;
  loadError: AppError | null;
}

export interface ChatDeps {
  /** A conversation's recorded turns and its choices. */
  load(id: number): Promise<{ turns: Turn[]; prefs: ConversationPrefs }>;
  /** A new chat's choices (kept on this machine). */
  newChatPrefs(): ConversationPrefs;
  /** A conversation's choices as the conversation list has them, if it has them. */
  listedPrefs(id: number): ConversationPrefs | null;
  savePrefs(conversation: ConversationKey, prefs: ConversationPrefs): Promise<void>;
}

export function emptyView(prefs: ConversationPrefs): ChatView {
  return { selected: null, loaded: { conversation: null, turns: [] }, live: null, prefs, loadError: null };
}

/**
 * The turns to show for the selected conversation: its own recorded turns (none while they
 * load: never another conversation's), with the live run's turn in place of its recorded copy
 * when the run is this conversation's, or after them.
 */
export function shownTurns(view: ChatView): Turn[] {
  const own = view.loaded.conversation === view.selected ? view.loaded.turns : [];
  const live = view.live;
  if (live === null || live.conversation !== view.selected) return own;
  return withTurn(own, live.turn);
}

/** `turns` with `turn` in place of the turn of the same run, or added at the end. */
function withTurn(turns: Turn[], turn: Turn): Turn[] {
  const run = turn.topology.run_id;
  const at = run === null ? -1 : turns.findIndex((t) => t.topology.run_id === run);
  return at < 0 ? [...turns, turn] : [...turns.slice(0, at), turn, ...turns.slice(at + 1)];
}

export class Chat {
  /** Counts loads; an answer that arrives after a newer selection or load is dropped. */
  private generation = 0;
  /** The user changed the choices shown since the conversation was selected. */
  private prefsChanged = false;

  constructor(
    readonly view: ChatView,
    private readonly deps: ChatDeps,
  ) {}

  get turns(): Turn[] {
    return shownTurns(this.view);
  }

  /** Whether a run is going, in any conversation (one at a time). */
  get running(): boolean {
    return this.view.live !== null;
  }

  /** Whether the run in flight is the shown conversation's. */
  get runningHere(): boolean {
    return this.view.live !== null && this.view.live.conversation === this.view.selected;
  }

  /**
   * Shows conversation `id`: its choices at once (a new chat's, or the conversation list's),
   * its turns once read from the history. `reload` reads them again for the same conversation
   * (a run was deleted). Resolves when the turns are shown, or dropped for a newer selection.
   */
  async select(id: ConversationKey, reload = false): Promise<void> {
    const view = this.view;
    const switched = id !== view.selected;
    if (!switched && !reload) return;
    const mine = ++this.generation;
    if (switched) {
      view.selected = id;
      view.prefs = id === null ? this.deps.newChatPrefs() : this.deps.listedPrefs(id);
      view.loadError = null;
      this.prefsChanged = false;
    }
    if (id === null) {
      view.loaded = { conversation: null, turns: [] };
      return;
    }
    try {
      const { turns, prefs } = await this.deps.load(id);
      if (mine !== this.generation) return;
      view.loaded = { conversation: id, turns };
      // Choices the user made meanwhile were saved, and win over what was read before.
      if (!this.prefsChanged) view.prefs = prefs;
      view.loadError = null;
    } catch (e) {
      if (mine === this.generation) view.loadError = e as AppError;
    }
  }

  /** The user's new choices for the shown conversation: shown, and saved there. */
  setPrefs(next: ConversationPrefs): void {
    if (this.view.prefs === null) return;
    this.view.prefs = next;
    this.prefsChanged = true;
    void this.deps.savePrefs(this.view.selected, next);
  }

  /**
   * The choices shown, adjusted without the user (the pool changed under them): shown, and
   * saved only for a new chat (a conversation keeps its choices by worker name).
   */
  adjustPrefs(next: ConversationPrefs): void {
    if (this.view.prefs === null) return;
    this.view.prefs = next;
    if (this.view.selected === null) void this.deps.savePrefs(null, next);
  }

  /** Starts a run in the shown conversation, with `turn` for it; returns that turn as tracked. */
  startRun(turn: Turn): Turn {
    const prefs = this.view.prefs ?? this.deps.newChatPrefs();
    this.view.live = { conversation: this.view.selected, turn, prefs };
    return this.view.live.turn;
  }

  /**
   * The run in flight has ended and is recorded as `runId` in conversation `conversationId`.
   * Its turn joins its conversation's turns. A new chat's first run makes the chat that
   * conversation: its choices are saved there (those shown now if the user is still on the new
   * chat, else those it was asked with; `saved` settles when they are), and if the user is still
   * on it, it becomes the shown conversation: `moved` (the caller selects it; nothing needs
   * reading).
   */
  endRun(runId: number | null, conversationId: number | null): { moved?: number; saved: Promise<void> } {
    const live = this.view.live;
    if (live === null) return { saved: Promise.resolve() };
    this.view.live = null;
    live.turn.live = false;
    live.turn.runId = runId;
    let conversation = live.conversation;
    let moved: number | undefined;
    let saved = Promise.resolve();
    if (conversation === null && conversationId !== null) {
      conversation = conversationId;
      const stayed = this.view.selected === null;
      saved = this.deps.savePrefs(conversationId, stayed && this.view.prefs ? this.view.prefs : live.prefs);
      if (stayed) {
        // Whatever a load for the new chat would bring is older than this.
        this.generation++;
        this.view.selected = conversationId;
        this.view.loaded = { conversation: conversationId, turns: [] };
        moved = conversationId;
      }
    }
    if (this.view.loaded.conversation === conversation) {
      this.view.loaded.turns = withTurn(this.view.loaded.turns, live.turn);
    }
    return { moved, saved };
  }

  /** The run in flight never got going (refused, or stopped before it started): its turn goes. */
  dropRun(): void {
    this.view.live = null;
  }
}

/**
 * Hands `apply` the items pushed since the last animation frame, once per frame: a run's
 * deltas arrive far more often than the screen is drawn, and each change re-renders.
 * `flush` hands them over at once (the run has ended).
 */
export function perFrame<T>(
  apply: (items: T[]) => void,
  schedule: (callback: () => void) => unknown = requestAnimationFrame,
): { push(item: T): void; flush(): void } {
  let queue: T[] = [];
  let scheduled = false;
  const flush = () => {
    scheduled = false;
    if (queue.length === 0) return;
    const items = queue;
    queue = [];
    apply(items);
  };
  return {
    push(item: T) {
      queue.push(item);
      if (!scheduled) {
        scheduled = true;
        schedule(flush);
      }
    },
    flush,
  };
}

/**
 * Follows the bottom of a scrolled list while the user is there: when they scroll up to read,
 * new content leaves the view alone; scrolling back to the bottom follows again.
 */
export class StickToBottom {
  /** Whether new content scrolls the view down. */
  sticking = true;
  private lastTop = 0;

  /** How close to the bottom, in pixels, counts as at the bottom. */
  constructor(private readonly slack = 24) {}

  /** Call on the list's scroll events. */
  scrolled(el: { scrollTop: number; scrollHeight: number; clientHeight: number }): void {
    const atBottom = el.scrollHeight - el.scrollTop - el.clientHeight <= this.slack;
    // Only a move up lets go: content growing below leaves scrollTop where it was.
    if (atBottom) this.sticking = true;
    else if (el.scrollTop < this.lastTop) this.sticking = false;
    this.lastTop = el.scrollTop;
  }

  /** Call after content changed: scrolls to the bottom if following. */
  follow(el: { scrollTop: number; scrollHeight: number; clientHeight: number }): void {
    if (!this.sticking) return;
    el.scrollTop = el.scrollHeight;
    this.lastTop = el.scrollTop;
  }

  /** Follows again (a conversation opened, the user asked something). */
  reset(): void {
    this.sticking = true;
  }
}
