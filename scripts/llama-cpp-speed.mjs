// llama.cpp's speed on a GGUF, through node-llama-cpp's prebuilt CPU build: prompt (prefill)
// and decode tokens per second, greedy, for a prompt of a given length in tokens. Used by
// scripts/bench-conductor-vs-llamacpp, which installs node-llama-cpp next to a copy of this file.
//
//   node llama-cpp-speed.mjs MODEL.gguf THREADS PROMPT_TOKENS GEN_TOKENS RUNS
//
// Prints one JSON object with the medians and every run's figures.
import { getLlama } from "node-llama-cpp";

const [modelPath, threadsArg, promptArg, genArg, runsArg] = process.argv.slice(2);
const threads = Number(threadsArg), promptTokens = Number(promptArg), gen = Number(genArg), runs = Number(runsArg);
if (!modelPath || ![threads, promptTokens, gen, runs].every((n) => Number.isInteger(n) && n > 0)) {
  console.error("usage: node llama-cpp-speed.mjs MODEL.gguf THREADS PROMPT_TOKENS GEN_TOKENS RUNS");
  process.exit(2);
}
const llama = await getLlama({ gpu: false });
const rssBefore = process.memoryUsage().rss;
const model = await llama.loadModel({ modelPath });
const modelMemory = process.memoryUsage().rss - rssBefore;
// Text like a conductor's prompt: a pool of workers and what a plan is. Each run's prompt
// starts differently, so nothing is reused between runs.
const text = (run) => {
  let t = `Run ${run}. You write workflows for a team of models. `;
  const workers = ["strong at math", "a careful reviewer", "fast and cheap", "strong at code"];
  for (let i = 0; t.length < promptTokens * 8; i++) {
    t += `Model ${i % 4} is ${workers[i % 4]}. A step sees the steps its access list names. `;
  }
  return t;
};
const median = (a) => [...a].sort((x, y) => x - y)[Math.floor(a.length / 2)];
const prefill = [], decode = [];
for (let run = 0; run < runs; run++) {
  const context = await model.createContext({ contextSize: promptTokens + gen + 64, threads });
  const sequence = context.getSequence();
  const tokens = model.tokenize(text(run)).slice(0, promptTokens);
  const started = performance.now();
  let first = 0, n = 0;
  for await (const _token of sequence.evaluate(tokens, { temperature: 0 })) {
    n++;
    if (n === 1) first = performance.now();
    if (n >= gen) break;
  }
  const ended = performance.now();
  prefill.push(tokens.length / ((first - started) / 1000));
  decode.push((n - 1) / ((ended - first) / 1000));
  await context.dispose();
}
console.log(JSON.stringify({
  engine: "llama.cpp (node-llama-cpp 3.22.1, prebuilt CPU build)", threads, prompt_tokens: promptTokens,
  gen_tokens: gen, runs, prompt_tokens_per_s: median(prefill), decode_tokens_per_s: median(decode),
  prompt_all: prefill, decode_all: decode,
  // Resident memory the model's load added, and the process's peak (maxRSS is in KiB).
  model_memory_mb: modelMemory / 2 ** 20, peak_rss_mb: process.resourceUsage().maxRSS / 1024,
}));
