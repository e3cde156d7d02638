// Typed wrappers over Baton's Tauri commands. Argument and result types come from the Rust
// types (bindings.ts); every command rejects with an AppError `{kind, message}`.
import { Channel, invoke } from "@tauri-apps/api/core";
import { listen, type UnlistenFn } from "@tauri-apps/api/event";
import type {
  AppError,
  AppInfo,
  AskRequest,
  AskResult,
  ChatComparison,
  CompareRequest,
  CompareResult,
  ConnectionCheck,
  ConversationSummary,
  Download,
  Draft,
  EvalProgress,
  EvalRequest,
  EvalView,
  Evaluation,
  ExportFormat,
  ExportTarget,
  KeysView,
  Learned,
  LearnRequest,
  LoadedModel,
  LocalApiForm,
  LocalApiStatus,
  ModelCatalog,
  ModelLoad,
  Plan,
  PoolForm,
  PoolLearning,
  Preferred,
  ProviderKind,
  RerunRequest,
  RunEvent,
  RunSummary,
  RunTree,
  SearchHit,
  Settings,
  SuiteInfo,
  WorkerFigures,
} from "./bindings";

/** Turns anything a command throws into an AppError the UI can branch on. */
export function asAppError(e: unknown): AppError {
  if (e && typeof e === "object" && "kind" in e && "message" in e) return e as AppError;
  return { kind: "io", message: String(e) };
}

export const api = {
  appInfo: () => invoke<AppInfo>("app_info"),
  /** Opens the log directory in the file manager; returns its path. */
  openLogsFolder: () => invoke<string>("open_logs_folder"),
  getSettings: () => invoke<Settings>("get_settings"),
  saveSettings: (form: PoolForm) => invoke<Settings>("save_settings", { form }),
  loadConductor: () => invoke<string>("load_conductor"),
  listKeys: () => invoke<KeysView>("list_keys"),
  setKey: (provider: ProviderKind, baseUrl: string | null, key: string) =>
    invoke<null>("set_key", { provider, baseUrl, key }),
  deleteKey: (provider: ProviderKind, baseUrl: string | null) => invoke<null>("delete_key", { provider, baseUrl }),
  /** The user allows the key in environment variable `var` to go to `origin` (a pairing the pool names). */
  allowEnvKey: (variable: string, origin: string) => invoke<null>("allow_env_key", { var: variable, origin }),
  /** A tiny request to worker `index` with a run's timeout and retries; `cancelRun(stopId)` stops it. */
  testWorker: (index: number, stopId: string) => invoke<ConnectionCheck>("test_worker", { index, stopId }),
  /** The conductor's plan for review; its text streams to `onDelta`; `cancelRun(draftId)` stops it. */
  draftPlan: (
    question: string,
    conversationId: number | null,
    workers: number[] | null,
    draftId: string,
    onDelta: (text: string) => void,
  ) => {
    const channel = new Channel<string>();
    channel.onmessage = onDelta;
    return invoke<Draft>("draft_plan", { question, conversationId, workers, draftId, onDelta: channel });
  },
  validatePlan: (plan: Plan, workers: number[] | null) => invoke<null>("validate_plan", { plan, workers }),
  /** Runs a question; `onEvent` sees every RunEvent in order; resolves when the run is recorded.
   * `cancelRun(stopId)` stops it from the start. */
  ask: (request: AskRequest, stopId: string, onEvent: (e: RunEvent) => void) => {
    const channel = new Channel<RunEvent>();
    channel.onmessage = onEvent;
    return invoke<AskResult>("ask", { request, stopId, onEvent: channel });
  },
  /** Asks the conductor and, at the same time, worker `request.worker` alone; each run's events
   * arrive on its own callback; `cancelRun(stopId)` stops both. */
  askCompared: (
    request: CompareRequest,
    stopId: string,
    onEvent: (e: RunEvent) => void,
    onSingle: (e: RunEvent) => void,
  ) => {
    const channel = new Channel<RunEvent>();
    channel.onmessage = onEvent;
    const single = new Channel<RunEvent>();
    single.onmessage = onSingle;
    return invoke<CompareResult>("ask_compared", { request, stopId, onEvent: channel, onSingle: single });
  },
  /** Marks the better answer of a comparison; null takes the mark back. */
  markComparison: (id: number, preferred: Preferred | null) => invoke<null>("mark_comparison", { id, preferred }),
  conversationComparisons: (id: number) => invoke<ChatComparison[]>("conversation_comparisons", { id }),
  /** Asks where in the save dialog and writes the marked comparisons as preference pairs; the path, or null. */
  exportPreferences: () => invoke<string | null>("export_preferences"),
  /** Runs one step of a finished run again with another worker (and the steps that see it). */
  rerunStep: (request: RerunRequest, stopId: string, onEvent: (e: RunEvent) => void) => {
    const channel = new Channel<RunEvent>();
    channel.onmessage = onEvent;
    return invoke<AskResult>("rerun_step", { request, stopId, onEvent: channel });
  },
  /** Stops a run or a plan being drafted, by the id it was started with. */
  cancelRun: (runId: string) => invoke<boolean>("cancel_run", { runId }),
  listConversations: (before: number | null = null) => invoke<ConversationSummary[]>("list_conversations", { before }),
  getConversation: (id: number) => invoke<ConversationSummary>("get_conversation", { id }),
  setConversationChoices: (id: number, workers: string[] | null, review: boolean) =>
    invoke<null>("set_conversation_choices", { id, workers, review }),
  conversationRuns: (id: number) => invoke<RunTree[]>("conversation_runs", { id }),
  listRuns: (before: number | null = null) => invoke<RunSummary[]>("list_runs", { before }),
  searchHistory: (query: string) => invoke<SearchHit[]>("search_history", { query }),
  getRun: (id: number) => invoke<RunTree>("get_run", { id }),
  deleteRun: (id: number) => invoke<null>("delete_run", { id }),
  deleteConversation: (id: number) => invoke<null>("delete_conversation", { id }),
  /** Asks where in the native save dialog and writes the export there; the path, or null if cancelled. */
  exportHistory: (target: ExportTarget, format: ExportFormat) =>
    invoke<string | null>("export_history", { target, format }),
  /** The curated conductor models for this computer, and what is downloaded. */
  modelCatalog: () => invoke<ModelCatalog>("model_catalog"),
  /** Downloads a model file (`owner/name:file`) and resolves to its path; progress arrives on
   * `onModelDownload`; `cancelRun(stopId)` stops it, keeping what is on disk for a resume. */
  pullModel: (reference: string, stopId: string) => invoke<string>("pull_model", { reference, stopId }),
  deleteModel: (reference: string) => invoke<null>("delete_model", { reference }),
  /** The local models loaded now: device, memory, and the speed of their latest generation. */
  loadedModels: () => invoke<LoadedModel[]>("loaded_models"),
  /** The built-in evaluation suites. */
  evalSuites: () => invoke<SuiteInfo[]>("eval_suites"),
  /** Runs (or, with the same id, resumes) an evaluation; progress goes to `onProgress`;
   * `cancelRun(stopId)` stops it, keeping every finished result. */
  runEvaluation: (request: EvalRequest, stopId: string, onProgress: (p: EvalProgress) => void) => {
    const channel = new Channel<EvalProgress>();
    channel.onmessage = onProgress;
    return invoke<EvalView>("run_evaluation", { request, stopId, onProgress: channel });
  },
  /** What the pool learned of each worker, and where each kind of question goes because of it. */
  poolLearning: () => invoke<PoolLearning>("pool_learning"),
  /** Runs every worker alone on a suite's items (or, the same suite again, goes on where a
   * stopped run ended); progress goes to `onProgress`; `cancelRun(stopId)` stops it, keeping
   * what was measured. */
  learnPool: (request: LearnRequest, stopId: string, onProgress: (p: EvalProgress) => void) => {
    const channel = new Channel<EvalProgress>();
    channel.onmessage = onProgress;
    return invoke<Learned>("learn_pool", { request, stopId, onProgress: channel });
  },
  /** Per worker over the whole history: calls, failures, latency, $, accuracy alone. */
  workerFigures: () => invoke<WorkerFigures[]>("worker_figures"),
  listEvaluations: () => invoke<Evaluation[]>("list_evaluations"),
  getEvaluation: (id: string) => invoke<EvalView>("get_evaluation", { id }),
  deleteEvaluation: (id: string) => invoke<null>("delete_evaluation", { id }),
  /** Asks where in the save dialog and writes the HTML report there; the path, or null. */
  exportEvaluation: (id: string) => invoke<string | null>("export_evaluation", { id }),
  localApiStatus: () => invoke<LocalApiStatus>("local_api_status"),
  /** Saves the [serve] settings and starts, stops or restarts the server to match. */
  saveLocalApi: (form: LocalApiForm) => invoke<LocalApiStatus>("save_local_api", { form }),
  restartLocalApi: () => invoke<LocalApiStatus>("restart_local_api"),
  /** The token clients send; `fresh` replaces it (and restarts a running server). */
  localApiToken: (fresh: boolean) => invoke<string>("local_api_token", { new: fresh }),
};

export function onModelDownload(handler: (download: Download) => void): Promise<UnlistenFn> {
  return listen<Download>("model-download", (e) => handler(e.payload));
}

export function onModelLoad(handler: (status: ModelLoad) => void): Promise<UnlistenFn> {
  return listen<ModelLoad>("conductor-status", (e) => handler(e.payload));
}

export function onHistoryWarning(handler: (message: string) => void): Promise<UnlistenFn> {
  return listen<string>("history-warning", (e) => handler(e.payload));
}
