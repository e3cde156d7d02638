// A small OpenAI-compatible chat server over llama.cpp's engine, through node-llama-cpp's
// prebuilt CPU build: a stand-in for llama.cpp's own `llama-server` where no llama-server binary
// can be had, so that Baton's remote conductor with a GBNF grammar (the `grammar` field
// llama-server accepts) can be exercised and timed against llama.cpp's real grammar engine.
// Installed next to node-llama-cpp 3.22.1 the way scripts/bench-conductor-vs-llamacpp installs
// llama-cpp-speed.mjs, and run from that directory:
//
//   node llama-cpp-server.mjs MODEL.gguf THREADS PORT [CONTEXT_SIZE]
//
// Loads the model on the CPU, listens on 127.0.0.1:PORT and prints one line,
// `listening on http://127.0.0.1:PORT/v1`, when ready; requests are logged to stderr.
//
//   GET  /v1/models             the model, named by its file name
//   POST /v1/chat/completions   messages (system, user, assistant), max_tokens (or
//                               max_completion_tokens), temperature (0 is greedy; llama-server's
//                               default 0.8 if absent), top_p, seed, stream,
//                               stream_options.include_usage, grammar (GBNF)
//   GET  /health                {"status":"ok"}
//
// The model's own chat template applies: the GGUF's Jinja template, through node-llama-cpp's
// LlamaChat and JinjaTemplateChatWrapper. One context sequence serves every request, one at a
// time, so a prompt that starts like the previous request's reuses that part of the KV cache,
// as llama-server's slot does; usage.prompt_tokens_details.cached_tokens says how many prompt
// tokens were reused. completion_tokens counts every sampled token, the end token included.
// Sampling follows llama-server's defaults (top-k 40, top-p 0.95, min-p 0.05, no repeat
// penalty). The context holds CONTEXT_SIZE tokens (node-llama-cpp may round a small one up; the
// size used is logged), or without it as much of the model's trained context as fits, up to
// 8192; a prompt that does not fit is refused, never shifted, and generation stops at its end.
import http from "node:http";
import path from "node:path";
import { randomUUID } from "node:crypto";
import {
  getLlama, LlamaChat, LlamaLogLevel, LlamaLogLevelGreaterThanOrEqual, resolveChatWrapper, TokenMeter,
} from "node-llama-cpp";

const [modelPath, threadsArg, portArg, contextArg] = process.argv.slice(2);
const threads = Number(threadsArg), port = Number(portArg);
const contextSize = contextArg === undefined ? undefined : Number(contextArg);
if (!modelPath || !Number.isInteger(threads) || threads <= 0 || !Number.isInteger(port) || port <= 0 ||
    (contextSize !== undefined && (!Number.isInteger(contextSize) || contextSize <= 0))) {
  console.error("usage: node llama-cpp-server.mjs MODEL.gguf THREADS PORT [CONTEXT_SIZE]");
  process.exit(2);
}
const modelName = path.basename(modelPath);
const log = (line) => process.stderr.write(`${line}\n`);

// llama.cpp's own log goes to stderr, so stdout carries only the "listening" line.
const llama = await getLlama({
  gpu: false,
  logger: (level, message) => {
    if (LlamaLogLevelGreaterThanOrEqual(level, LlamaLogLevel.warn)) log(`llama.cpp: ${message.trimEnd()}`);
  },
});
const model = await llama.loadModel({ modelPath });
// Without a size, as much of the model's trained context as fits, up to 8192 tokens.
const context = await model.createContext({ contextSize: contextSize ?? { max: 8192 }, threads });
const sequence = context.getSequence();
// The GGUF's own Jinja template, rendered as llama-server renders it; node-llama-cpp's built-in
// equivalent wrapper can differ (its ChatML wrapper adds a BOS token that llama-server does not).
// A GGUF without a template gets the wrapper node-llama-cpp guesses for it.
const chatWrapper = resolveChatWrapper(model, { type: "jinjaTemplate" });
const chat = new LlamaChat({ contextSequence: sequence, chatWrapper });
log(`${modelName}: context ${context.contextSize} tokens, ${threads} threads, ` +
  `chat template ${chat.chatWrapper.wrapperName}`);

/** An error answered as OpenAI does: `{"error": {...}}` with an HTTP status. */
class RequestError extends Error {
  constructor(message, status = 400, type = "invalid_request_error") {
    super(message);
    this.status = status;
    this.type = type;
  }
}

/** A message's text: a string, or OpenAI's array of content parts (text parts only). */
function textOf(content, i) {
  if (typeof content === "string") return content;
  if (Array.isArray(content) && content.every((p) => p?.type === "text" && typeof p.text === "string")) {
    return content.map((p) => p.text).join("");
  }
  throw new RequestError(`messages[${i}].content must be a string or text parts`);
}

/** Checks a request body and turns it into what a generation needs. */
function parseRequest(body) {
  const bad = (message) => { throw new RequestError(message); };
  if (body === null || typeof body !== "object" || Array.isArray(body)) bad("the body must be a JSON object");
  const { messages, temperature, top_p: topP, seed, stream = false, stream_options: streamOptions, grammar } = body;
  if (!Array.isArray(messages) || messages.length === 0) bad("messages must be a non-empty array");
  const history = messages.map((m, i) => {
    const text = textOf(m?.content, i);
    switch (m?.role) {
      case "system":
      case "developer":
        return { type: "system", text };
      case "user":
        return { type: "user", text };
      case "assistant":
        return { type: "model", response: [text] };
      default:
        return bad(`messages[${i}].role must be system, user or assistant`);
    }
  });
  const maxTokens = body.max_tokens ?? body.max_completion_tokens;
  if (maxTokens != null && !(Number.isInteger(maxTokens) && maxTokens > 0)) bad("max_tokens must be a positive integer");
  if (temperature != null && !(typeof temperature === "number" && temperature >= 0)) bad("temperature must be >= 0");
  if (topP != null && (typeof topP !== "number" || topP <= 0 || topP > 1)) bad("top_p must be in (0, 1]");
  if (seed != null && !Number.isInteger(seed)) bad("seed must be an integer");
  if (typeof stream !== "boolean") bad("stream must be a boolean");
  if (grammar != null && typeof grammar !== "string") bad("grammar must be a GBNF string");
  return {
    history, maxTokens, temperature: temperature ?? 0.8, topP: topP ?? 0.95, seed, stream,
    includeUsage: stream && streamOptions?.include_usage === true, grammar: grammar || undefined,
  };
}

/**
 * Runs one chat completion on the shared sequence. `onDelta(field, text)` gets each piece of
 * text as it is generated (field "content", or "reasoning_content" for a thinking model's
 * thoughts). Resolves to the usage figures and the finish reason.
 */
async function complete(req, onDelta, signal) {
  let grammar;
  if (req.grammar !== undefined) {
    try {
      grammar = await llama.createGrammar({ grammar: req.grammar });
    } catch (e) {
      throw new RequestError(`failed to parse grammar: ${e?.message ?? e}`);
    }
  }
  // The prompt as LlamaChat will lay it out: the history, then an opened assistant turn
  // (or the last assistant message, continued).
  const history = req.history.at(-1).type === "model"
    ? req.history : [...req.history, { type: "model", response: [] }];
  const { contextText } = chat.chatWrapper.generateContextState({ chatHistory: history });
  const promptTokens = contextText.tokenize(model.tokenizer);
  const room = context.contextSize - promptTokens.length - 1;
  if (room <= 0) {
    throw new RequestError(`the prompt has ${promptTokens.length} tokens, more than a context of ` +
      `${context.contextSize} allows`, 400, "exceed_context_size_error");
  }
  // At least the prompt's last token is always evaluated again, so that there is something to
  // sample from.
  const { firstDifferentIndex } = sequence.compareContextTokens(promptTokens);
  const cachedTokens = Math.min(firstDifferentIndex, promptTokens.length - 1);
  const meter = sequence.tokenMeter.getState();
  const started = performance.now();
  let firstToken;
  const result = await chat.generateResponse(req.history, {
    maxTokens: Math.min(req.maxTokens ?? room, room),
    temperature: req.temperature,
    ...(req.temperature > 0 ? { topK: 40, topP: req.topP, minP: 0.05, seed: req.seed } : {}),
    repeatPenalty: false,
    grammar,
    signal,
    stopOnAbortSignal: true,
    onToken: () => { firstToken ??= performance.now(); },
    onResponseChunk: (chunk) => {
      if (chunk.text === "") return;
      if (chunk.type === undefined) onDelta("content", chunk.text);
      else if (chunk.segmentType === "thought") onDelta("reasoning_content", chunk.text);
    },
  });
  const ended = performance.now();
  const completionTokens = TokenMeter.diff(sequence.tokenMeter.getState(), meter).usedOutputTokens;
  return {
    text: result.response,
    finishReason: result.metadata.stopReason === "maxTokens" ? "length" : "stop",
    stopReason: result.metadata.stopReason,
    usage: {
      prompt_tokens: promptTokens.length,
      completion_tokens: completionTokens,
      total_tokens: promptTokens.length + completionTokens,
      prompt_tokens_details: { cached_tokens: cachedTokens },
    },
    firstTokenMs: firstToken === undefined ? undefined : firstToken - started,
    totalMs: ended - started,
  };
}

// One generation at a time: each request waits for the ones before it.
let queue = Promise.resolve();
function enqueue(job) {
  const run = queue.then(job);
  queue = run.catch(() => {});
  return run;
}

function sendJson(res, status, value) {
  const body = JSON.stringify(value);
  res.writeHead(status, { "content-type": "application/json", "content-length": Buffer.byteLength(body) });
  res.end(body);
}

function sendError(res, e) {
  const status = e instanceof RequestError ? e.status : 500;
  const type = e instanceof RequestError ? e.type : "server_error";
  if (!(e instanceof RequestError)) log(`error: ${e?.stack ?? e}`);
  const error = { message: String(e?.message ?? e), type, code: status };
  if (res.headersSent) {
    // Mid-stream there is no status left to send: the error goes in a data event.
    res.end(`data: ${JSON.stringify({ error })}\n\n`);
  } else {
    sendJson(res, status, { error });
  }
}

async function readBody(req) {
  const chunks = [];
  let size = 0;
  for await (const chunk of req) {
    size += chunk.length;
    if (size > 64 << 20) throw new RequestError("the body is larger than 64 MiB", 413);
    chunks.push(chunk);
  }
  try {
    return JSON.parse(Buffer.concat(chunks).toString("utf8"));
  } catch (e) {
    throw new RequestError(`the body is not JSON: ${e.message}`);
  }
}

async function chatCompletions(httpReq, res) {
  const req = parseRequest(await readBody(httpReq));
  const id = `chatcmpl-${randomUUID()}`;
  const created = Math.floor(Date.now() / 1000);
  // A client that goes away stops its generation; what was generated so far is discarded.
  const abort = new AbortController();
  res.on("close", () => { if (!res.writableFinished) abort.abort(); });
  const chunk = (choices, extra = {}) => {
    const value = { id, object: "chat.completion.chunk", created, model: modelName, choices, ...extra };
    return `data: ${JSON.stringify(value)}\n\n`;
  };

  const job = enqueue(async () => {
    if (abort.signal.aborted) return undefined;
    if (!req.stream) return complete(req, () => {}, abort.signal);
    let opened = false;
    const open = () => {
      if (opened) return;
      opened = true;
      res.writeHead(200, {
        "content-type": "text/event-stream", "cache-control": "no-cache", connection: "keep-alive",
      });
      res.write(chunk([{ index: 0, delta: { role: "assistant", content: null }, finish_reason: null }]));
    };
    // Grammar and context errors are found before the first token, while a status can still
    // be sent; the stream opens with the first piece of text (or at the end).
    const result = await complete(req, (field, text) => {
      open();
      res.write(chunk([{ index: 0, delta: { [field]: text }, finish_reason: null }]));
    }, abort.signal);
    open();
    return result;
  });
  let out;
  try {
    out = await job;
  } catch (e) {
    if (!abort.signal.aborted) throw e;
  }
  if (abort.signal.aborted) {
    log(`cancelled: the client went away${out ? ` after ${out.usage.completion_tokens} generated tokens` : ""}`);
    return;
  }
  const { usage } = out;
  log(`${req.stream ? "stream" : "plain"}: ${usage.prompt_tokens} prompt tokens ` +
    `(${usage.prompt_tokens_details.cached_tokens} cached), ` +
    `${usage.completion_tokens} generated, first token ${out.firstTokenMs?.toFixed(0) ?? "-"} ms, ` +
    `total ${out.totalMs.toFixed(0)} ms, ${out.stopReason}${req.grammar ? ", grammar" : ""}`);
  if (!req.stream) {
    sendJson(res, 200, {
      id, object: "chat.completion", created, model: modelName,
      choices: [{ index: 0, message: { role: "assistant", content: out.text }, finish_reason: out.finishReason }],
      usage: out.usage,
    });
    return;
  }
  res.write(chunk([{ index: 0, delta: {}, finish_reason: out.finishReason }]));
  if (req.includeUsage) res.write(chunk([], { usage: out.usage }));
  res.end("data: [DONE]\n\n");
}

const server = http.createServer(async (req, res) => {
  const url = new URL(req.url, "http://localhost");
  const route = url.pathname.replace(/^\/v1(?=\/)/, "");
  log(`${req.method} ${url.pathname}`);
  try {
    if (req.method === "GET" && route === "/models") {
      sendJson(res, 200, { object: "list", data: [{ id: modelName, object: "model", owned_by: "llama.cpp" }] });
    } else if (req.method === "GET" && route === "/health") {
      sendJson(res, 200, { status: "ok" });
    } else if (req.method === "POST" && route === "/chat/completions") {
      await chatCompletions(req, res);
    } else {
      throw new RequestError(`no route for ${req.method} ${url.pathname}`, 404, "not_found_error");
    }
  } catch (e) {
    sendError(res, e);
  }
});
server.listen(port, "127.0.0.1", () => {
  process.stdout.write(`listening on http://127.0.0.1:${port}/v1\n`);
});
