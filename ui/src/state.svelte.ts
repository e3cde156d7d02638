// App-wide state shared by the views: settings, the conversation list, the current view, and
// news from the backend (model loading, history warnings).
import { api, asAppError } from "./api";
import type { AppError, ConversationSummary, Download, ModelLoad, Settings } from "./bindings";
import { formatCost } from "./lib/figures";

export { figuresLine, formatCost, totalsBreakdown } from "./lib/figures";
import { choiceOf, namesOf } from "./lib/choices";

export type View = "chat" | "history" | "workers" | "conductor" | "evaluate" | "local-api" | "welcome";

export const app = $state({
  view: "chat" as View,
  settings: null as Settings | null,
  settingsError: null as AppError | null,
  conversations: [] as ConversationSummary[],
  conversationsError: null as AppError | null,
  /** The open conversation; null for a new one. */
  conversationId: null as number | null,
  modelLoad: null as ModelLoad | null,
  /** Model downloads by reference: the latest news of each (running, finished, failed, stopped),
   * kept here so progress survives a look at another screen. */
  downloads: {} as Record<string, Download>,
  warning: null as string | null,
  /** The screen with edits not saved yet ("Workers & keys", "Conductor"), if any. */
  unsaved: null as string | null,
  /** The chat holds a plan under review, which leaving its conversation drops. */
  reviewing: false,
  /** Counts deletions from the history, so screens showing what was deleted load again. */
  historyVersion: 0,
  /** The conversation a run is going in (`null`: a new chat's first run), if any. */
  runningIn: undefined as number | null | undefined,
});

/** Whether the user may leave the current screen: yes, or they confirm dropping its edits. */
export function mayLeave(): boolean {
  if (!app.unsaved) return true;
  if (!confirm(`${app.unsaved} has changes that are not saved. Leave and drop them?`)) return false;
  app.unsaved = null;
  return true;
}

/** Whether the user may open another conversation: as [`mayLeave`], and a plan under review
 * (which belongs to the open conversation) is dropped only if they confirm. */
export function mayLeaveConversation(): boolean {
  if (!mayLeave()) return false;
  if (app.reviewing && !confirm("A plan is waiting for review in this conversation. Leave it and drop the plan?")) {
    return false;
  }
  return true;
}

/** Keeps `app.unsaved` in step with a screen's `dirty` state while the screen is shown. */
export function trackUnsaved(screen: string, dirty: () => boolean): void {
  $effect(() => {
    app.unsaved = dirty() ? screen : null;
    return () => {
      if (app.unsaved === screen) app.unsaved = null;
    };
  });
}

export async function refreshSettings(): Promise<void> {
  try {
    app.settings = await api.getSettings();
    app.settingsError = null;
  } catch (e) {
    app.settingsError = asAppError(e);
  }
}

export async function refreshConversations(): Promise<void> {
  try {
    app.conversations = await api.listConversations();
    app.conversationsError = null;
  } catch (e) {
    app.conversationsError = asAppError(e);
  }
}

/** Whether the welcome screen should show: no workers yet, or no conductor for a pool that needs one. */
export function needsSetup(s: Settings | null): boolean {
  return s !== null && ((!s.conductor_configured && s.conductor_needed) || (s.form?.workers.length ?? 0) === 0);
}

/**
 * A conversation's choices as the chat works with them. The history keeps them per
 * conversation, by worker name (pool numbers change when the pool is edited); a chat not yet
 * started keeps them on this machine, and they become its own when it starts.
 */
export interface ConversationPrefs {
  /** Pool indices this conversation may use; null for all. */
  workers: number[] | null;
  /** Chosen workers that are not in the pool now: kept, so that saving does not drop them. */
  missing: string[];
  review: boolean;
}

const NEW_CHAT_KEY = "baton.new-chat-prefs";
/** Where earlier versions kept every conversation's choices (by pool index); read once and moved. */
const LEGACY_KEY = "baton.conversation-prefs";

function stored<T>(key: string): T | null {
  try {
    return JSON.parse(localStorage.getItem(key) ?? "null") as T | null;
  } catch {
    return null;
  }
}

/** A new chat's choices: the last ones made for a new chat on this machine. */
export function newChatPrefs(): ConversationPrefs {
  const saved = stored<Partial<ConversationPrefs>>(NEW_CHAT_KEY);
  return { workers: saved?.workers ?? null, missing: [], review: saved?.review ?? false };
}

/** The choices a conversation keeps in the history, as pool indices of the pool as it is now. */
export function prefsOf(c: ConversationSummary): ConversationPrefs {
  const legacy = stored<Record<string, { workers: number[] | null; review: boolean }>>(LEGACY_KEY)?.[String(c.id)];
  if (legacy && c.workers === null && !c.review) {
    const moved = { workers: legacy.workers, missing: [], review: legacy.review };
    void savePrefs(c.id, moved).then(() => {
      const rest = stored<Record<string, unknown>>(LEGACY_KEY) ?? {};
      delete rest[String(c.id)];
      localStorage.setItem(LEGACY_KEY, JSON.stringify(rest));
    });
    return moved;
  }
  if (c.workers === null) return { workers: null, missing: [], review: c.review };
  return { ...choiceOf(c.workers, app.settings?.workers ?? []), review: c.review };
}

export async function savePrefs(conversation: number | null, prefs: ConversationPrefs): Promise<void> {
  if (conversation === null) {
    localStorage.setItem(NEW_CHAT_KEY, JSON.stringify({ workers: prefs.workers, review: prefs.review }));
    return;
  }
  const chosen = prefs.workers;
  const workers = chosen === null ? null : [...namesOf(chosen, app.settings?.workers ?? []), ...prefs.missing];
  try {
    await api.setConversationChoices(conversation, workers, prefs.review);
    const c = app.conversations.find((c) => c.id === conversation);
    if (c) Object.assign(c, { workers, review: prefs.review });
  } catch (e) {
    app.warning = `This conversation's choice of workers and review was not saved: ${asAppError(e).message}`;
  }
}


export function formatMs(ms: number): string {
  return ms < 1000 ? `${ms} ms` : `${(ms / 1000).toFixed(1)} s`;
}

/** A run's cost figures as every view shows them: calls, tokens, cost, and time when known. */
export function runFigures(r: {
  calls: number;
  tokens: number;
  cost_usd: number;
  cost_complete?: boolean;
  wall_ms: number | null;
}): string[] {
  const figures = [`${r.calls} call${r.calls === 1 ? "" : "s"}`, `${r.tokens} tokens`, formatCost(r.cost_usd, r.cost_complete ?? true)];
  if (r.wall_ms !== null) figures.push(formatMs(r.wall_ms));
  return figures;
}
