// Generated from Baton's Rust types by `src-tauri/src/bindings.rs`; do not edit.
// Regenerate: UPDATE_BINDINGS=1 cargo test -p baton-desktop bindings

export type JsonValue = number | string | boolean | Array<JsonValue> | { [key in string]?: JsonValue } | null;

export type ProviderKind = "openai" | "anthropic" | "gemini" | "openai-compatible" | "local";

export type Role = "user" | "assistant";

export type Message = { role: Role, content: string, };

export type Usage = { 
/**
 * Every input token, whether served from a cache, written to one, or neither.
 */
input_tokens: number, 
/**
 * Includes reasoning ("thinking") tokens, which providers bill as output.
 */
output_tokens: number, 
/**
 * Of `input_tokens`, those read from a prompt cache (the provider's, or a local model's
 * prefix cache); providers bill them at a discount.
 */
cached_input_tokens: number, 
/**
 * Of `input_tokens`, those written to a prompt cache (Anthropic bills them at a premium).
 */
cache_write_input_tokens: number, 
/**
 * Some of these counts are Baton's upper estimate, not the provider's report: a call cut
 * off before its usage arrived (OpenAI reports it only at the end) is still billed for
 * what it sent. See `Usage::estimate_cut_call`.
 */
estimated?: boolean, };

export type Plan = { model_id: Array<number>, subtasks: Array<string>, access_list: Array<Access> };

export type Access = "all" | Array<number>;

export type WorkerInfo = { index: number, name: string, provider: ProviderKind, model: string, description: string | null, };

export type StepRef = { round: number, step: number, };

export type RerunOf = { run_id: string, step: number, };

export type StepErrorKind = "auth" | "rate_limited" | "overloaded" | "bad_request" | "context_too_long" | "network" | "timeout" | "malformed_response" | "empty_answer" | "cancelled" | "dependency_failed" | "conductor" | "recursion_limit" | "budget";

export type StepError = { kind: StepErrorKind, message: string, 
/**
 * The HTTP status, when a provider answered with one.
 */
status?: number | null, };

export type RunErrorKind = "invalid_plan" | "step_failed" | "budget_exceeded" | "conductor";

export type RunError = { kind: RunErrorKind, message: string, };

export type Figures = { 
/**
 * Requests sent, retries and failed attempts included.
 */
calls: number, usage: Usage, 
/**
 * Sum over calls with a known price.
 */
cost_usd: number, 
/**
 * False when some call's price is unknown, so `cost_usd` is a lower bound.
 */
cost_complete: boolean, };

export type Totals = { 
/**
 * Requests sent, retries and failed attempts included.
 */
calls: number, usage: Usage, 
/**
 * Sum over calls with a known price.
 */
cost_usd: number, 
/**
 * False when some call's price is unknown, so `cost_usd` is a lower bound.
 */
cost_complete: boolean, 
/**
 * The conductor's share: its calls writing plans (a local conductor costs $0, its tokens count).
 */
conductor: Figures, 
/**
 * The workers' share.
 */
workers: Figures, 
/**
 * Who made calls with no known price (worker names, or "the conductor").
 */
cost_unknown_for: Array<string>, wall_ms: number, 
/**
 * Steps of round 0 that finished or failed (nested rounds are in the events).
 */
steps_finished: Array<number>, steps_failed: Array<number>, 
/**
 * Plans written, recursive rounds included.
 */
rounds: number, };

export type PlanPrompt = { 
/**
 * The prompt's version (`v2`, `v3`, …), from the conductor's prompt files.
 */
version: string, system: string, messages: Array<Message>, };

export type RunEvent = { "type": "run_started", run_id: string, question: string, workers: Array<WorkerInfo>, 
/**
 * The conductor that writes plans, when there is one.
 */
conductor?: string | null, 
/**
 * Set when this run re-runs one step of an earlier run with another worker.
 */
rerun_of?: RerunOf | null, } | { "type": "plan_started", round: number, depth: number, 
/**
 * The step that handed work back to the conductor (recursion), if any.
 */
parent?: StepRef | null, } | { "type": "plan_delta", round: number, text: string, } | { "type": "plan_ready", round: number, depth: number, parent?: StepRef | null, plan: Plan, 
/**
 * The conductor's whole answer; absent for a given plan.
 */
raw?: string | null, 
/**
 * The conductor's tokens for this plan (prompt, of it cached, and written); absent
 * for a given plan.
 */
usage?: Usage | null, 
/**
 * What those tokens cost; absent for a given plan, and when the conductor's price is
 * unknown.
 */
cost_usd?: number | null, 
/**
 * Why the conductor's generation ended: `stop` (its end token), `length` (its token cap),
 * or `complete` (Baton ended the stream once the plan was whole).
 */
stop_reason?: string | null, 
/**
 * Exactly what the conductor was asked for this plan (its prompt version, system
 * prompt and messages); absent for a given plan and a fallback.
 */
prompt?: PlanPrompt | null, 
/**
 * Set when this plan is not the conductor's: its plans could not be used (why, and
 * who answers instead), so the question goes to one worker alone.
 */
fallback?: string | null, } | { "type": "plan_rejected", round: number, reason: string, 
/**
 * The rejected plan's text, when the conductor finished one.
 */
raw?: string | null, 
/**
 * What the conductor was asked for it, as in `PlanReady`.
 */
prompt?: PlanPrompt | null, retry: boolean, } | { "type": "step_started", round: number, step: number, 
/**
 * Index of the worker in the pool; the pool's size means the conductor itself.
 */
worker: number, 
/**
 * Exactly what the worker is sent.
 */
system: string | null, messages: Array<Message>, } | { "type": "step_delta", round: number, step: number, text: string, } | { "type": "step_retrying", round: number, step: number, 
/**
 * The attempt that failed (1 for the first).
 */
attempt: number, error: StepError, delay_ms: number, } | { "type": "step_finished", round: number, step: number, output: string, usage: Usage, 
/**
 * `None` when the worker's price is unknown.
 */
cost_usd: number | null, 
/**
 * From `StepStarted` to the last token, retries included.
 */
latency_ms: number, retries: number, } | { "type": "step_failed", round: number, step: number, error: StepError, } | { "type": "step_reused", round: number, step: number, worker: number, output: string, 
/**
 * The run the output comes from.
 */
from_run: string, } | { "type": "run_finished", answer: string, totals: Totals, } | { "type": "run_failed", error: RunError, totals: Totals, } | { "type": "run_cancelled", totals: Totals, };

export type RunStatus = "running" | "finished" | "failed" | "cancelled" | "interrupted";

export type RunSummary = { id: number, conversation_id: number, question: string, status: RunStatus, 
/**
 * Unix milliseconds.
 */
started_at: number, wall_ms: number | null, calls: number, input_tokens: number, output_tokens: number, cost_usd: number, };

export type ConversationSummary = { id: number, title: string, created_at: number, updated_at: number, runs: number, 
/**
 * The workers (by name) this conversation may use; `None` for all of the pool.
 */
workers: Array<string> | null, 
/**
 * Whether its plans are shown for review before they run.
 */
review: boolean, };

export type SearchHit = { id: number, conversation_id: number, question: string, status: RunStatus, started_at: number, 
/**
 * `question`, `answer` or `subtask`.
 */
matched: string, snippet: string, };

export type RunTree = { run: RunRecord, plans: Array<PlanRecord>, steps: Array<StepRecord>, events: Array<JsonValue>, };

export type RunRecord = { id: number, uid: string, conversation_id: number, question: string, conductor: string | null, workers: Array<WorkerInfo>, status: RunStatus, answer: string | null, error_kind: string | null, error: string | null, started_at: number, finished_at: number | null, rounds: number, calls: number, input_tokens: number, output_tokens: number, cost_usd: number, 
/**
 * False when a worker had no price, so `cost_usd` is a lower bound.
 */
cost_complete: boolean, 
/**
 * The engine's figures for the run (conductor and workers apart, cached tokens, who had
 * no price); `None` while it runs, and for runs recorded before they were kept.
 */
totals: Totals | null, wall_ms: number | null, 
/**
 * The run and step this run re-ran with another worker, if it is a re-run.
 */
rerun_of: RerunOf | null, };

export type RejectedPlan = { reason: string, 
/**
 * The attempt's text, when the conductor finished one.
 */
raw: string | null, 
/**
 * What the conductor was asked for it.
 */
prompt: PlanPrompt | null, };

export type PlanRecord = { round: number, depth: number, parent: StepRef | null, 
/**
 * The conductor's whole text; `None` for a written plan.
 */
raw: string | null, plan: Plan, 
/**
 * The conductor's tokens for this plan; `None` for a written plan (or one recorded before
 * they were kept).
 */
usage: Usage | null, 
/**
 * Why the conductor's generation ended (`stop`, `length`).
 */
stop_reason: string | null, 
/**
 * The conductor's exact request for this plan; absent for a written plan, a fallback, or
 * one recorded before requests were kept. (Absent fields keep older exports as they were.)
 */
prompt?: PlanPrompt | null, 
/**
 * The conductor's attempts that could not be used, in order.
 */
rejected?: Array<RejectedPlan>, 
/**
 * Why this plan is one worker alone instead of the conductor's (absent: it is not).
 */
fallback?: string | null, };

export type StepRecord = { round: number, step: number, worker_index: number, worker: string, subtask: string, access: Access, 
/**
 * Exactly what the worker was sent; `None` when the step never ran.
 */
request: SentRequest | null, 
/**
 * `running`, `finished`, `failed`, `cancelled` (the run stopped while the step waited or
 * answered) or `interrupted`.
 */
status: string, 
/**
 * The answer; for a `cancelled` step, the text that had arrived when the run stopped.
 */
output: string | null, error_kind: string | null, error: string | null, input_tokens: number | null, 
/**
 * Of `input_tokens`, read from a prompt cache; `None` before this was kept.
 */
cached_input_tokens: number | null, 
/**
 * Of `input_tokens`, written to a prompt cache.
 */
cache_write_input_tokens: number | null, output_tokens: number | null, cost_usd: number | null, latency_ms: number | null, retries: number, 
/**
 * For a step a re-run kept rather than ran: the run its output comes from.
 */
reused_from: string | null, };

export type SentRequest = { system: string | null, messages: Array<Message>, };

export type ErrorKind = "bad_input" | "pool" | "conductor" | "keychain" | "history" | "provider" | "not_found" | "io" | "cancelled" | "download" | "key_not_allowed";

export type KeyConsent = { 
/**
 * The environment variable the pool names (`api_key_env`).
 */
var: string, 
/**
 * Where its key would go: scheme, host and port.
 */
origin: string, 
/**
 * Who sends it: `worker "gpt"`, `the conductor`.
 */
owner: string, };

export type AppError = { kind: ErrorKind, message: string, 
/**
 * Set only for [`ErrorKind::KeyNotAllowed`].
 */
consent?: KeyConsent, };

export type WorkerForm = { 
/**
 * Index of the table this worker was read from, so a save keeps its other keys and
 * comments; `None` for a new worker.
 */
original: number | null, name: string, provider: ProviderKind, model: string, base_url: string | null, api_key_env: string | null, max_tokens: number | null, temperature: number | null, reasoning_effort: string | null, thinking_budget: number | null, 
/**
 * $ per million input tokens.
 */
price_in: number | null, price_out: number | null, 
/**
 * $ per million input tokens read from a prompt cache (default: `price_in`).
 */
price_cached_in: number | null, description: string | null, };

export type ConductorForm = { 
/**
 * A local `.gguf` file or safetensors directory; with `url`, the model name the server serves.
 */
model: string | null, 
/**
 * An OpenAI-compatible server that runs the conductor.
 */
url: string | null, 
/**
 * With `url`: the server's plan-grammar field (`vllm`, `sglang`, `llama.cpp`), or `None`
 * to parse its answers.
 */
grammar: string | null, 
/**
 * `auto` (GPU when there is one) or `cpu` ([`Device`]), as the file says it: a name the
 * pool refuses is shown and refused on save, not replaced unseen.
 */
device: string, max_steps: number, recursion: boolean, max_depth: number, 
/**
 * When the conductor's plans cannot be used (they fail, copy an example, or keep the
 * question from the workers), answer with one worker alone (`[conductor] fallback`).
 */
fallback: boolean, max_calls: number | null, max_tokens: number | null, max_cost_usd: number | null, };

export type PoolForm = { workers: Array<WorkerForm>, conductor: ConductorForm, };

export type Settings = { pool_path: string, history_path: string, pool_exists: boolean, 
/**
 * `null` when the file is not valid TOML (see `pool_error`).
 */
form: PoolForm | null, 
/**
 * What is wrong with the pool as it stands, if anything; runs are refused until it is fixed.
 */
pool_error: string | null, 
/**
 * The workers the conductor sees, in order (empty while the pool has errors).
 */
workers: Array<WorkerInfo>, 
/**
 * Whether a conductor (local model or server) is set.
 */
conductor_configured: boolean, 
/**
 * False when the pool routes every question by what it learned (`route = "always"`), so
 * it runs without a conductor.
 */
conductor_needed: boolean, 
/**
 * Whether this build runs local models (mistral.rs).
 */
local_models: boolean, 
/**
 * Workers with no known price (neither the pool nor the price data has one): a cost cap
 * cannot count them, and their runs' costs are lower bounds.
 */
unpriced: Array<string>, };

export type KeyRow = { 
/**
 * The keychain account (`openai`, `openai-compatible:<url>`, …).
 */
account: string, provider: ProviderKind, 
/**
 * The server the key is for, when that is not the provider's official host (always for
 * `openai-compatible` keys).
 */
base_url: string | null, 
/**
 * The pool's workers (and the conductor) that use this key.
 */
used_by: Array<string>, stored: boolean, last4: string | null, 
/**
 * Set when the pool takes this key from an environment variable, which wins over the keychain.
 */
env_override: string | null, };

export type KeysView = { 
/**
 * `null` when the keychain works; otherwise what is missing and how to fix it.
 */
keychain_error: string | null, keys: Array<KeyRow>, };

export type ModelLoad = { "state": "loading", what: string, path: string, } | { "state": "loaded", what: string, path: string, seconds: number, device: string, } | { "state": "failed", what: string, path: string, };

export type AskRequest = { question: string, 
/**
 * Continue this conversation (the conductor sees its earlier turns); `null` starts one.
 */
conversation_id: number | null, 
/**
 * The pool workers this conversation may use, by index; `null` for all of them.
 */
workers: Array<number> | null, 
/**
 * A reviewed plan to run instead of asking the conductor; its worker numbers refer to
 * `workers` in order.
 */
plan: Plan | null, };

export type AskResult = { 
/**
 * The run's id in the history (`null` if it could not be recorded).
 */
run_id: number | null, conversation_id: number | null, status: string, };

export type RerunRequest = { 
/**
 * The finished run, by its id in the history.
 */
run_id: number, 
/**
 * The step of the question's plan (round 0).
 */
step: number, 
/**
 * The worker to run it with, by name (numbers change when the pool file is edited).
 */
worker: string, };

export type Draft = { plan: Plan, 
/**
 * The conductor's whole text (empty when routed).
 */
raw: string, 
/**
 * Set when no conductor wrote the plan: what the pool learned sends the question to one
 * worker, and why.
 */
routed: string | null, workers: Array<WorkerInfo>, max_steps: number, };

export type ConnectionCheck = { 
/**
 * The first words of the answer.
 */
reply: string, latency_ms: number, 
/**
 * Retries it took (rate limits, overload, timeouts), as a run's step would make them.
 */
retries: number, };

export type ExportFormat = "markdown" | "json";

export type ExportTarget = { "kind": "run", "id": number } | { "kind": "conversation", "id": number };

export type AppInfo = { version: string, 
/**
 * Whether this build runs local models (the conductor needs one, or a server).
 */
local_models: boolean, 
/**
 * Whether local models can use a GPU in this build.
 */
gpu: boolean, 
/**
 * Where the app (and the command line) write their logs.
 */
log_dir: string, 
/**
 * What this build runs local models on: `cuda`, `metal` or `cpu`.
 */
build_device: string, 
/**
 * On a machine with an NVIDIA GPU this build does not use: how to build for it.
 */
gpu_advice: string | null, };

export type ModelChoice = { 
/**
 * `gpu`, `cpu`, `slow` (fits, but slow on a CPU) or `too_big`.
 */
fit: string, recommended: boolean, 
/**
 * The downloaded file, when it is here.
 */
path: string | null, id: string, name: string, 
/**
 * `owner/name:file`, as `baton models pull` takes it.
 */
reference: string, quantization: string, 
/**
 * The file's size as the hub lists it (the download reads the exact figure from the hub).
 */
size_gb: number, 
/**
 * What running it as the conductor takes: weights, a 4k-token context, the runtime.
 */
memory_gb: number, licence: string, licence_url: string, 
/**
 * Fast enough to conduct on a CPU alone.
 */
cpu: boolean, summary: string, };

export type DownloadedModel = { reference: string, path: string, bytes: number, size: number, complete: boolean, };

export type ModelCatalog = { models: Array<ModelChoice>, 
/**
 * This computer in a line: memory and GPU.
 */
machine: string, 
/**
 * What this build runs local models on: `cuda`, `metal` or `cpu`.
 */
build_device: string, 
/**
 * On a machine with an NVIDIA GPU this build does not use: how to build for it.
 */
gpu_advice: string | null, 
/**
 * Where downloads go.
 */
models_dir: string, 
/**
 * The hub downloads come from (`HF_ENDPOINT` or huggingface.co).
 */
hub: string, downloaded: Array<DownloadedModel>, };

export type Download = { "state": "running", reference: string, 
/**
 * `resolving`, `checking` (reading back an earlier part), `downloading`, `reconnecting`.
 */
phase: string, done: number, total: number, 
/**
 * Over the last few seconds; 0 until there is a measure.
 */
bytes_per_sec: number, eta_secs: number | null, } | { "state": "finished", reference: string, path: string, size: number, 
/**
 * The SHA-256 the file was checked against (`null` for a small non-LFS file).
 */
sha256: string | null, 
/**
 * Where it went on from (0: from the start).
 */
resumed_from: number, 
/**
 * It was downloaded already.
 */
cached: boolean, } | { "state": "failed", reference: string, 
/**
 * `gated`, `not_found`, `unreachable`, `hub`, `checksum`, `no_space`, `busy`, `io`.
 */
kind: string, message: string, } | { "state": "stopped", reference: string, have: number, size: number, };

export type LoadedModel = { path: string, device: string, load_seconds: number, 
/**
 * How much the process's memory grew while it loaded (Linux).
 */
memory_bytes: number | null, 
/**
 * Its latest generation (a plan, for the conductor): prompt and decode rates, tokens.
 */
prompt_tokens_per_sec: number | null, decode_tokens_per_sec: number | null, last_prompt_tokens: number | null, last_cached_prompt_tokens: number | null, last_output_tokens: number | null, };

export type Evaluation = { id: string, suite: string, suite_sha256: string, 
/**
 * The harness's own JSON (strategies, repeats, choices made along the way).
 */
config: JsonValue, status: string, spent_usd: number, created_at: number, updated_at: number, 
/**
 * Results recorded so far.
 */
results: number, };

export type EvalResult = { strategy: string, item_id: string, repeat: number, 
/**
 * `calibration` or `test`.
 */
split: string, category: string, 
/**
 * The item's kind (`number`, `choice`, `code`, `exact`); none in results kept before
 * kinds were (schema 12).
 */
kind: string | null, run_uid: string | null, 
/**
 * The run's number in the history (`baton history show N`), while it is there; read, never
 * written.
 */
run_id: number | null, answer: string | null, extracted: string | null, correct: boolean, error: string | null, plan_valid: boolean | null, steps: number | null, 
/**
 * The run's calls, tokens and dollars, conductor and workers together. What the history
 * keeps of a result: not the tokens written to a prompt cache, nor whether a count was
 * estimated.
 */
figures: Figures, 
/**
 * The conductor's tokens, a share of `figures.usage` (the same limits).
 */
conductor_usage: Usage, latency_ms: number, };

export type WorkerFigures = { 
/**
 * The worker's name (`conductor` for steps the conductor gave itself).
 */
worker: string, 
/**
 * Steps that called the worker (a step re-used by a re-run, or one that never started
 * because a step it needed failed, is no call).
 */
calls: number, 
/**
 * Calls that ended with an answer.
 */
finished: number, 
/**
 * Calls that ended with the worker's error (after the retries a step makes).
 */
failed: number, 
/**
 * Calls stopped by the user or a spending cap: neither a success nor a failure.
 */
cancelled: number, 
/**
 * `failed` over the calls that ended on their own (finished or failed); `None` if none did.
 */
failure_rate: number | null, 
/**
 * Retries the calls needed (rate limits, overload, timeouts).
 */
retries: number, 
/**
 * Over finished calls, from the request to the last token, retries included.
 */
latency_p50_ms: number | null, latency_p95_ms: number | null, input_tokens: number, output_tokens: number, 
/**
 * Of finished calls. A failed call has no usage (providers do not bill an error); a call
 * stopped mid-answer was billed for what it wrote, which is not known.
 */
cost_usd: number, 
/**
 * False when a finished call had no known price, or a call was stopped mid-answer:
 * `cost_usd` is then a lower bound.
 */
cost_complete: boolean, 
/**
 * When the worker was last called (Unix ms).
 */
last_called_at: number | null, 
/**
 * The worker alone (`single:<name>`) in the newest evaluation that ran it.
 */
evaluation: WorkerAccuracy | null, };

export type WorkerAccuracy = { evaluation_id: string, suite: string, accuracy: number, 
/**
 * Results scored (items × repeats).
 */
n: number, at: number, };

export type Preferred = "conductor" | "single" | "tie";

export type ChatComparison = { id: number, conversation_id: number, conductor_run: number | null, single_run: number | null, 
/**
 * The worker that answered alone.
 */
worker: string, preferred: Preferred | null, created_at: number, marked_at: number | null, };

export type CompareRequest = { question: string, 
/**
 * Continue this conversation; `null` starts one.
 */
conversation_id: number | null, 
/**
 * The pool workers the conductor may use, by index; `null` for all of them.
 */
workers: Array<number> | null, 
/**
 * The worker that answers alone, by name (any worker of the pool, chosen or not).
 */
worker: string, };

export type CompareResult = { conductor: AskResult, single: AskResult, 
/**
 * The comparison kept in the history, to mark the better answer (`null` if neither run
 * could be recorded).
 */
comparison_id: number | null, };

export type StrategySummary = { strategy: string, 
/**
 * Mean over test items of each item's mean over repeats.
 */
accuracy: number, 
/**
 * Standard error of `accuracy` over items.
 */
stderr: number, 
/**
 * Test items scored.
 */
n: number, 
/**
 * Runs scored (items × repeats).
 */
runs: number, 
/**
 * Every run's calls, tokens and dollars, summed. `cost_complete` is false when some call
 * had no known price: `cost_usd` is then a lower bound.
 */
figures: Figures, 
/**
 * The conductor's share of the tokens.
 */
conductor_usage: Usage, cost_per_item_usd: number, latency_p50_ms: number, latency_p95_ms: number, 
/**
 * Conductor runs: the share whose plan could be run.
 */
plan_validity: number | null, 
/**
 * Steps per run (every round).
 */
mean_steps: number | null, 
/**
 * Runs that failed (no answer).
 */
failures: number, 
/**
 * On the cost–accuracy Pareto front.
 */
pareto: boolean, };

export type Comparison = { a: string, b: string, pairs: number, 
/**
 * Items only `a` got right, and only `b` (an item counts as right when at least half its
 * repeats are): McNemar's discordant pairs, one per item.
 */
only_a: number, only_b: number, mcnemar_p: number, difference: number, bootstrap_low: number, bootstrap_high: number, bootstrap_p: number, };

export type Report = { id: string, suite: string, status: string, spent_usd: number, strategies: Array<StrategySummary>, comparisons: Array<Comparison>, 
/**
 * The x axis of the front: `usd` per item, or `tokens` per item when some strategy's cost
 * is unknown or every cost is zero (local models).
 */
cost_axis: string, pareto_front: Array<string>, 
/**
 * RouterBench's AIQ of all strategies together.
 */
aiq: number, config: JsonValue, };

export type SuiteInfo = { name: string, provenance: string, items: number, };

export type EvalRequest = { 
/**
 * A built-in suite's name.
 */
suite: string, 
/**
 * `conductor`, `single:W`, `moa`, `router:lookup`, `router:random`, `best-of-n:W`, `oracle`.
 */
strategies: Array<string>, 
/**
 * Items to draw (stratified by category); `null` for all.
 */
limit: number | null, max_cost_usd: number | null, 
/**
 * Names the evaluation; the same id resumes it. `null`: the suite's name and the time.
 */
id: string | null, 
/**
 * Runs of every strategy per item (`null`: 1).
 */
repeats: number | null, 
/**
 * Runs in flight at once (`null`: 4).
 */
concurrency: number | null, 
/**
 * Share of each category kept to calibrate the lookup router and MoA's aggregator (`null`:
 * 0.3 when one of them is asked for).
 */
calibration: number | null, 
/**
 * Seed for sampling, splits and the random router (`null`: 1).
 */
seed: number | null, };

export type EvalProgress = { "type": "started", id: string, about: string, } | { "type": "planned", total: number, done: number, } | { "type": "scored", strategy: string, item: string, correct: boolean, cost_usd: number, spent_usd: number, } | { "type": "note", text: string, };

export type EvalView = { evaluation: Evaluation, report: Report, results: Array<EvalResult>, };

export type CategoryFigures = { right: number, 
/**
 * Runs scored (items × repeats).
 */
n: number, 
/**
 * Dollars per run; 0 for local models and unpriced calls (see `cost_complete`).
 */
cost_per_item_usd: number, cost_complete: boolean, latency_p50_ms: number, 
/**
 * Input and output tokens per run.
 */
tokens_per_item: number, };

export type Freshness = "current" | "stale" | "none";

export type CategoryRow = { category: string, 
/**
 * How it is shown: the category, or for a kind over categories "any multiple-choice".
 */
label: string, figures: CategoryFigures, low: number, high: number, };

export type WorkerLearning = { worker: string, freshness: Freshness, 
/**
 * The identity it was learned as (for a stale profile, not [`Self::identity_now`]).
 */
identity_learned: string | null, identity_now: string, 
/**
 * Whether its calls have a price (else its cost shows as unknown, not as $0).
 */
priced: boolean, learned_in: Array<string>, categories: Array<CategoryRow>, 
/**
 * Per kind, over every category; only kinds that are not a category of their own (those
 * are in [`Self::categories`] already).
 */
kinds: Array<CategoryRow>, marks: ChatMarks, };

export type ChatMarks = { 
/**
 * Marked better than the conductor's answer.
 */
better: number, 
/**
 * Marked as good.
 */
tie: number, 
/**
 * The conductor's answer marked better.
 */
worse: number, };

export type Route = "auto" | "always" | "never";

export type RouteHow = "always" | "clear" | "no_gain" | "lead" | "workflow";

export type KindRoute = { 
/**
 * The category, or with [`Self::by_kind`] the kind.
 */
category: string, 
/**
 * A route by the question's kind, for a question not placed in a category of its own.
 */
by_kind: boolean, 
/**
 * How it is shown: the category, or for a kind "other multiple-choice".
 */
label: string, 
/**
 * The worker alone, or with [`RouteHow::Workflow`] the workflow's first worker.
 */
worker: string, 
/**
 * With [`RouteHow::Workflow`], the workflow in words: "a, then b seeing a's answer".
 */
workflow: string | null, how: RouteHow, };

export type PoolLearning = { 
/**
 * In the pool's order.
 */
workers: Array<WorkerLearning>, 
/**
 * The conductor's sampled plans, scored as a worker's answers are, where they were
 * measured with this conductor over these workers.
 */
plans: WorkerLearning | null, 
/**
 * The workflows search found while the pool learned, each with its figures (`worker` is
 * the workflow in words), on this pool's workers.
 */
workflows: Array<WorkerLearning>, 
/**
 * Each learned kind of question and the worker (or workflow) it goes to.
 */
routes: Array<KindRoute>, 
/**
 * The worker the pool names as its fallback (`fallback_worker`): then what was learned
 * routes nothing (and with `route = "always"` every question goes to it).
 */
named_fallback: string | null, 
/**
 * `[conductor] route`.
 */
route: Route, 
/**
 * How varied the conductor's sampled plans were, where they were measured.
 */
plan_variety: PlanVariety | null, };

export type PlanVariety = { samples: number, distinct: number, };

export type LearnRequest = { 
/**
 * A built-in suite's name, or the path of a JSONL file of items with answers.
 */
suite: string, 
/**
 * Items to learn from (stratified by category); `null` for all.
 */
limit: number | null, 
/**
 * Plans the conductor samples and runs per item; `null`: the default
 * (`baton_eval::learn::DEFAULT_PLANS`), 0: the workers alone only.
 */
plans: number | null, 
/**
 * Dollars the run may spend at most (priced calls); `null`: no cap. Learning the same
 * items again with a higher cap goes on where it stopped.
 */
max_cost_usd: number | null, };

export type Learned = { 
/**
 * The learning run's id (the same request goes on with it).
 */
id: string, 
/**
 * `finished`, `stopped` or `over_budget`.
 */
ended: string, learning: PoolLearning, };

export type LocalApiForm = { 
/**
 * Serve while the app is open (`app`).
 */
enabled: boolean, 
/**
 * Must be what the file says (`127.0.0.1` when it says nothing): only the pool file can
 * change it, since anything but loopback opens the server to the network.
 */
host: string, 
/**
 * 0 picks a free port each time.
 */
port: number, max_concurrent_runs: number, daily_max_cost_usd: number | null, 
/**
 * Web clients (origins such as `http://localhost:3000`) allowed to call from a browser.
 */
allow_origins: Array<string>, };

export type LocalApiStatus = { 
/**
 * The settings as the pool file has them.
 */
form: LocalApiForm, running: boolean, 
/**
 * It is starting, stopping or restarting now (a conductor may be loading).
 */
busy: boolean, 
/**
 * The base URL clients use (`http://127.0.0.1:8765/v1`) while it runs.
 */
url: string | null, 
/**
 * The model ids served (`baton`, `baton/<worker>`).
 */
models: Array<string>, 
/**
 * Where the token comes from: the keychain, or the environment variable `[serve]` names.
 */
token_source: string, requests: number, failed_requests: number, runs_in_flight: number, 
/**
 * Requests waiting for a run slot.
 */
runs_queued: number, spent_today_usd: number, 
/**
 * The pool file changed since the server started; a restart applies it.
 */
stale: boolean, 
/**
 * Why the server is not running when it should be (the last start failed).
 */
error: string | null, };
