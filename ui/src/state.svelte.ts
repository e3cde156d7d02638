// App-wide state shared by the views: settings, the conversation list, the current view, and
// news from the backend (model loading, history warnings).
import { api, asAppError } from "./api";
import type { AppError, ConversationSummary, ModelLoad, Settings } from "./bindings";

export type View = "chat" | "history" | "workers" | "conductor" | "welcome";

export const app = $state({
  view: "chat" as View,
  settings: null as Settings | null,
  settingsError: null as AppError | null,
  conversations: [] as ConversationSummary[],
  conversationsError: null as AppError | null,
  /** The open conversation; null for a new one. */
  conversationId: null as number | null,
  modelLoad: null as ModelLoad | null,
  warning: null as string | null,
  /** The screen with edits not saved yet ("Workers & keys", "Conductor"), if any. */
  unsaved: null as string | null,
});

/** Whether the user may leave the current screen: yes, or they confirm dropping its edits. */
export function mayLeave(): boolean {
  if (!app.unsaved) return true;
  if (!confirm(`${app.unsaved} has changes that are not saved. Leave and drop them?`)) return false;
  app.unsaved = null;
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

/** Whether the welcome screen should show: nothing set up yet. */
export function needsSetup(s: Settings | null): boolean {
  return s !== null && (!s.conductor_configured || (s.form?.workers.length ?? 0) === 0);
}

/** Per-conversation choices the user makes in the chat (kept on this machine, not in the pool). */
export interface ConversationPrefs {
  /** Pool indices this conversation may use; null for all. */
  workers: number[] | null;
  review: boolean;
}

const PREFS_KEY = "baton.conversation-prefs";

export function loadPrefs(conversation: number | null): ConversationPrefs {
  const all = JSON.parse(localStorage.getItem(PREFS_KEY) ?? "{}") as Record<string, ConversationPrefs>;
  return all[String(conversation ?? "new")] ?? { workers: null, review: false };
}

export function savePrefs(conversation: number | null, prefs: ConversationPrefs): void {
  const all = JSON.parse(localStorage.getItem(PREFS_KEY) ?? "{}") as Record<string, ConversationPrefs>;
  all[String(conversation ?? "new")] = prefs;
  localStorage.setItem(PREFS_KEY, JSON.stringify(all));
}

export function formatCost(usd: number, complete = true): string {
  const s = usd === 0 ? "$0" : usd < 0.01 ? `$${usd.toFixed(4)}` : `$${usd.toFixed(2)}`;
  return complete ? s : `≥ ${s}`;
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
