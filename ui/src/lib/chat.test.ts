import { describe, expect, it, vi } from "vitest";
import type { ConversationPrefs } from "../state.svelte";
import type { ChatComparison } from "../bindings";
import {
  Chat,
  emptyView,
  pairTurns,
  perFrame,
  StickToBottom,
  type ChatDeps,
  type ConversationKey,
  type Turn,
} from "./chat";
import { emptyTopology } from "./topology";

function turn(key: string, run: string | null, question = key): Turn {
  const topology = { ...emptyTopology(), run_id: run, question };
  return { key, topology, live: run === null, runId: null };
}

const prefs = (workers: number[] | null, review = false): ConversationPrefs => ({ workers, missing: [], review });

/** A promise and the functions that settle it, to decide when a load answers. */
function deferred<T>() {
  let resolve!: (value: T) => void;
  let reject!: (error: unknown) => void;
  const promise = new Promise<T>((res, rej) => ((resolve = res), (reject = rej)));
  return { promise, resolve, reject };
}

/** Two recorded conversations: A (1) with one turn and B (2) with two. */
function setup() {
  const history: Record<number, { turns: Turn[]; prefs: ConversationPrefs }> = {
    1: { turns: [turn("a1", "run-a1")], prefs: prefs([0], false) },
    2: { turns: [turn("b1", "run-b1"), turn("b2", "run-b2")], prefs: prefs(null, true) },
  };
  const saved: Array<[ConversationKey, ConversationPrefs]> = [];
  const deps: ChatDeps = {
    load: async (id) => ({ turns: [...history[id].turns], prefs: history[id].prefs }),
    newChatPrefs: () => prefs(null, false),
    listedPrefs: (id) => history[id]?.prefs ?? null,
    savePrefs: async (conversation, p) => {
      saved.push([conversation, p]);
    },
  };
  const view = emptyView(deps.newChatPrefs());
  return { chat: new Chat(view, deps), view, history, saved, deps };
}

const keys = (turns: Turn[]) => turns.map((t) => t.key);

describe("Chat: conversations and the run in flight", () => {
  it("shows only the selected conversation's turns and choices while a run goes in another", async () => {
    const { chat, view, saved, history } = setup();
    await chat.select(1);
    const live = chat.startRun(turn("live", null, "asked in A"));
    live.topology.run_id = "run-new";
    expect(keys(chat.turns)).toEqual(["a1", "live"]);
    expect(chat.runningHere).toBe(true);

    const switching = chat.select(2);
    // Until B's turns are read, nothing is shown: never A's turns under B.
    expect(chat.turns).toEqual([]);
    expect(view.prefs).toEqual(history[2].prefs);
    await switching;
    expect(keys(chat.turns)).toEqual(["b1", "b2"]);
    expect(chat.running).toBe(true);
    expect(chat.runningHere).toBe(false);

    // A choice made in B is B's.
    chat.setPrefs({ ...view.prefs!, workers: [1] });
    expect(saved).toEqual([[2, prefs([1], true)]]);

    // Back in A, the run is there, in place of the copy the history has of it so far.
    history[1].turns.push(turn("h-run-new", "run-new"));
    await chat.select(1);
    expect(keys(chat.turns)).toEqual(["a1", "live"]);
    expect(view.prefs).toEqual(prefs([0], false));
    live.topology.question = "changed while shown";
    expect(chat.turns[1].topology.question).toBe("changed while shown");

    expect(chat.endRun(42, 1)).toMatchObject({ moved: undefined });
    expect(chat.running).toBe(false);
    expect(keys(chat.turns)).toEqual(["a1", "live"]);
    expect(chat.turns[1]).toMatchObject({ live: false, runId: 42 });
  });

  it("lets a run that ends elsewhere join its conversation when that is read again", async () => {
    const { chat, history } = setup();
    await chat.select(1);
    chat.startRun(turn("live", null));
    await chat.select(2);
    chat.endRun(43, 1);
    expect(keys(chat.turns)).toEqual(["b1", "b2"]);
    history[1].turns.push(turn("h43", "run-43"));
    await chat.select(1);
    expect(keys(chat.turns)).toEqual(["a1", "h43"]);
  });

  it("drops a load that answers after another conversation was selected", async () => {
    const { chat, view, deps } = setup();
    const slow = deferred<{ turns: Turn[]; prefs: ConversationPrefs }>();
    const load = deps.load;
    deps.load = (id) => (id === 1 ? slow.promise : load(id));
    const first = chat.select(1);
    await chat.select(2);
    slow.resolve({ turns: [turn("late", "run-late")], prefs: prefs([3]) });
    await first;
    expect(keys(chat.turns)).toEqual(["b1", "b2"]);
    expect(view.prefs).toEqual(prefs(null, true));
  });

  it("keeps choices made while a conversation is being read", async () => {
    const { chat, view, deps, saved } = setup();
    const slow = deferred<{ turns: Turn[]; prefs: ConversationPrefs }>();
    deps.load = () => slow.promise;
    const loading = chat.select(2);
    chat.setPrefs(prefs([0], true));
    slow.resolve({ turns: [], prefs: prefs(null, true) });
    await loading;
    expect(view.prefs).toEqual(prefs([0], true));
    expect(saved).toEqual([[2, prefs([0], true)]]);
  });

  it("waits with the choices of a conversation the list does not have yet", async () => {
    const { chat, view, deps, saved } = setup();
    const slow = deferred<{ turns: Turn[]; prefs: ConversationPrefs }>();
    deps.load = () => slow.promise;
    deps.listedPrefs = () => null;
    const loading = chat.select(2);
    expect(view.prefs).toBeNull();
    chat.setPrefs(prefs([0]));
    expect(saved).toEqual([]);
    slow.resolve({ turns: [], prefs: prefs([1], true) });
    await loading;
    expect(view.prefs).toEqual(prefs([1], true));
  });

  it("makes a new chat its conversation when its first run ends there", async () => {
    const { chat, view, saved, deps } = setup();
    await chat.select(null);
    chat.startRun(turn("live", null));
    // Changed during the run, on the same chat: these are what the conversation keeps.
    chat.setPrefs(prefs([1], true));
    const { moved, saved: done } = chat.endRun(7, 9);
    await done;
    expect(moved).toBe(9);
    expect(view.selected).toBe(9);
    expect(keys(chat.turns)).toEqual(["live"]);
    expect(saved.at(-1)).toEqual([9, prefs([1], true)]);
    // Selecting it (as the view does next) reads nothing: the turn is already there.
    const load = vi.spyOn(deps, "load");
    await chat.select(9);
    expect(load).not.toHaveBeenCalled();
    expect(keys(chat.turns)).toEqual(["live"]);
  });

  it("keeps a new chat's run out of the conversation the user moved to", async () => {
    const { chat, view, saved } = setup();
    await chat.select(null);
    chat.startRun(turn("live", null));
    expect(keys(chat.turns)).toEqual(["live"]);
    await chat.select(2);
    chat.setPrefs(prefs([0], true));
    const { moved } = chat.endRun(8, 10);
    expect(moved).toBeUndefined();
    expect(view.selected).toBe(2);
    expect(keys(chat.turns)).toEqual(["b1", "b2"]);
    // The new conversation keeps the choices it was asked with; B keeps its own.
    expect(saved).toEqual([
      [2, prefs([0], true)],
      [10, prefs(null, false)],
    ]);
    await chat.select(null);
    expect(chat.turns).toEqual([]);
  });

  it("shows a new chat's run on the new chat, wherever the user went meanwhile", async () => {
    const { chat } = setup();
    chat.startRun(turn("live", null));
    await chat.select(1);
    expect(keys(chat.turns)).toEqual(["a1"]);
    await chat.select(null);
    expect(keys(chat.turns)).toEqual(["live"]);
  });

  it("drops the turn of a run that never got going", async () => {
    const { chat } = setup();
    await chat.select(1);
    chat.startRun(turn("live", null));
    chat.dropRun();
    expect(keys(chat.turns)).toEqual(["a1"]);
    expect(chat.running).toBe(false);
  });

  it("reads the same conversation again when asked to", async () => {
    const { chat, history } = setup();
    await chat.select(2);
    history[2].turns.pop();
    await chat.select(2);
    expect(keys(chat.turns)).toEqual(["b1", "b2"]);
    await chat.select(2, true);
    expect(keys(chat.turns)).toEqual(["b1"]);
  });

  it("saves adjusted choices only for a new chat", async () => {
    const { chat, saved } = setup();
    chat.adjustPrefs(prefs([2]));
    await chat.select(1);
    chat.adjustPrefs(prefs([1]));
    expect(saved).toEqual([[null, prefs([2])]]);
  });

  it("reports a failed load for the conversation shown only", async () => {
    const { chat, view, deps } = setup();
    deps.load = async (id) => {
      throw { kind: "history", message: `cannot read ${id}` };
    };
    await chat.select(1);
    expect(view.loadError?.message).toBe("cannot read 1");
    await chat.select(null);
    expect(view.loadError).toBeNull();
  });
});

describe("perFrame", () => {
  it("hands over what arrived since the last frame, once per frame", () => {
    const frames: Array<() => void> = [];
    const applied: number[][] = [];
    const batch = perFrame<number>((items) => applied.push(items), (f) => frames.push(f));
    batch.push(1);
    batch.push(2);
    batch.push(3);
    expect(frames).toHaveLength(1);
    expect(applied).toEqual([]);
    frames.shift()!();
    expect(applied).toEqual([[1, 2, 3]]);
    batch.push(4);
    // The run ended: what is left goes now, and the frame after has nothing to do.
    batch.flush();
    frames.shift()!();
    expect(applied).toEqual([[1, 2, 3], [4]]);
  });
});

describe("StickToBottom", () => {
  const list = (scrollTop: number, scrollHeight: number) => ({ scrollTop, scrollHeight, clientHeight: 100 });

  it("follows new content until the user scrolls up, and again once back at the bottom", () => {
    const stick = new StickToBottom();
    const el = list(0, 300);
    /** The user scrolls to `top` (null: stays put), then content grows to `height`. */
    const step = (top: number | null, height: number) => {
      if (top !== null) el.scrollTop = top;
      stick.scrolled(el);
      el.scrollHeight = height;
      stick.follow(el);
      return el.scrollTop;
    };
    stick.follow(el);
    expect(el.scrollTop).toBe(300);
    // Content grows below: still following.
    expect(step(null, 500)).toBe(500);
    // The user scrolls up to read: new content leaves the view where it is.
    expect(step(200, 800)).toBe(200);
    // Scrolling down but not to the bottom does not follow yet.
    expect(step(400, 800)).toBe(400);
    // Back at the bottom: following again.
    expect(step(700, 900)).toBe(900);
  });

  it("follows again after a reset", () => {
    const stick = new StickToBottom();
    const el = list(500, 1000);
    stick.scrolled(el);
    el.scrollTop = 100;
    stick.scrolled(el);
    expect(stick.sticking).toBe(false);
    stick.reset();
    stick.follow(el);
    expect(el.scrollTop).toBe(1000);
  });
});

describe("pairTurns", () => {
  const recorded = (key: string, runId: number): Turn => ({ ...turn(key, `uid-${runId}`), live: false, runId });
  const comparison = (id: number, conductor: number | null, single: number | null): ChatComparison => ({
    id,
    conversation_id: 1,
    conductor_run: conductor,
    single_run: single,
    worker: "fast",
    preferred: id === 1 ? "single" : null,
    created_at: 0,
    marked_at: null,
  });

  it("puts each worker-alone run beside its conductor run's turn", () => {
    const turns = [recorded("q1", 1), recorded("q1-alone", 2), recorded("q2", 3), recorded("q3", 4), recorded("q3-alone", 5)];
    const shown = pairTurns(turns, [comparison(1, 1, 2), comparison(2, 4, 5)]);
    expect(shown.map((t) => t.key)).toEqual(["q1", "q2", "q3"]);
    expect(shown[0].compare).toMatchObject({ worker: "fast", runId: 2, comparisonId: 1, preferred: "single" });
    expect(shown[0].compare?.topology).toBe(turns[1].topology);
    expect(shown[1].compare).toBeUndefined();
    expect(shown[2].compare).toMatchObject({ runId: 5, comparisonId: 2, preferred: null });
  });

  it("keeps a worker-alone run as a turn when its conductor run was deleted, and skips a deleted worker run", () => {
    const turns = [recorded("alone", 2), recorded("q2", 3)];
    const shown = pairTurns(turns, [comparison(1, null, 2), comparison(2, 3, null)]);
    expect(shown.map((t) => t.key)).toEqual(["alone", "q2"]);
    expect(shown.every((t) => t.compare === undefined)).toBe(true);
  });
});
