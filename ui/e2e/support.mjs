// What the end-to-end tests share: the paths `scripts/e2e` passes in the environment, the
// loopback provider server, the tauri-driver sessions and the app each drives, and helpers to
// find, click and read what the app shows, read the history it wrote and the requests the
// workers got. `setUp` and `tearDown` are `app.test.mjs`'s `before` and `after`; `driver` is
// the session in use (`openApp` starts one, `closeApp` ends it).

import { execFileSync, spawn } from "node:child_process";
import { readFileSync, writeFileSync, mkdirSync } from "node:fs";
import { join } from "node:path";
import { Builder, By, until } from "selenium-webdriver";

const env = (name) => {
  const v = process.env[name];
  if (!v) throw new Error(`${name} is not set; run the end-to-end tests through scripts/e2e`);
  return v;
};
export const APP = env("BATON_E2E_APP");
export const WORK = env("BATON_E2E_WORK");
export const SHOTS = env("BATON_E2E_SHOTS");
export const BATON = env("BATON_E2E_CLI");
export const TESTSERVER = env("BATON_E2E_TESTSERVER");
const TINYMODEL = env("BATON_E2E_TINYMODEL");
// The real test model (SmolLM2-135M-Instruct GGUF), served by a loopback hub for the first-run download.
export const REAL_MODEL = env("BATON_E2E_REAL_MODEL");

export const KEY = "sk-e2e-" + Math.random().toString(36).slice(2) + "-canary";
export const DB = join(WORK, "history.sqlite");
export const POOL = join(WORK, "pool.toml");
// The app writes when each step's first text leaves the engine here (BATON_TIMING_LOG).
export const TIMING = join(WORK, "timing.jsonl");
// What the app asked the desktop to open (see the fake xdg-open in `setUp`).
export const OPENED = join(WORK, "opened.txt");
export const REPLIES = {
  alpha: "Alpha says the answer is 42, after careful thought about the question",
  beta: "Beta agrees: the answer is **42**",
  xss: "<img src=x onerror=window.pwned=1> and <script>window.pwned=2</script> done",
};
export const figures = {};

let server;
let hub;
export let serverAddress;
let serverLog;
export let driver;
// Every tauri-driver started, each the leader of a process group that `tearDown` ends.
const driverProcesses = [];

export function wireName(name) {
  // The test server reads its script from the model name; `_` stands for a space there.
  return `${name};reply=${REPLIES[name].replaceAll(" ", "_")};latency=1200`;
}

export async function setUp() {
  mkdirSync(SHOTS, { recursive: true });
  const model = join(WORK, "tiny-model");
  execFileSync(TINYMODEL, [model]);
  serverLog = join(WORK, "requests.jsonl");
  server = spawn(TESTSERVER, ["--key", KEY, "--log", serverLog], { stdio: ["ignore", "pipe", "inherit"] });
  const address = (serverAddress = await new Promise((resolve, reject) => {
    server.stdout.once("data", (d) => resolve(String(d).trim().replace("listening on ", "")));
    server.once("exit", (code) => reject(new Error(`the test server exited with ${code}`)));
  }));
  conductorModel = model;
  writePool(Object.fromEntries(Object.keys(REPLIES).map((name) => [name, wireName(name)])));
  // The desktop's "open this folder" command, replaced by one that notes its argument.
  const bin = join(WORK, "bin");
  mkdirSync(bin);
  writeFileSync(join(bin, "xdg-open"), `#!/bin/sh\nprintf '%s\\n' "$1" >> '${OPENED}'\n`, { mode: 0o755 });
  await startDriver(DRIVER_PORT, {
    PATH: `${bin}:${process.env.PATH}`,
    BATON_POOL: POOL,
    BATON_DB: DB,
    BATON_LOG_DIR: join(WORK, "logs"),
    BATON_TIMING_LOG: TIMING,
    BATON_E2E_CONDUCTOR_KEY: KEY,
  });
}

export async function tearDown() {
  await driver?.quit().catch(() => {});
  // Each tauri-driver leads a process group with its WebKitWebDriver and the app it started:
  // the whole group goes, so no app outlives the tests (or holds their output open).
  for (const child of driverProcesses) {
    if (child?.exitCode === null) killGroup(child);
  }
  server?.kill();
  hub?.kill();
  writeFileSync(join(SHOTS, "figures.json"), JSON.stringify(figures, null, 2));
}

export const DRIVER_PORT = 4444;
let conductorModel;

/** Writes the pool: the tiny conductor and `workers` (name → model string) on the test server. */
export function writePool(workers, maxSteps = 3) {
  const tables = Object.entries(workers).map(
    ([name, model]) => `[[worker]]
name = "${name}"
provider = "openai"
model = "${model}"
base_url = "${serverAddress}/v1"
description = "${name} worker"
max_tokens = 8192
`,
  );
  writeFileSync(
    POOL,
    `max_steps = ${maxSteps}

[conductor]
model = "${conductorModel}"
device = "cpu"
max_reasoning_chars = 40
max_subtask_chars = 60

${tables.join("\n")}`,
  );
}

/** Ends `child`'s process group: the polite signal first, then the one that cannot be ignored. */
function killGroup(child) {
  for (const signal of ["SIGTERM", "SIGKILL"]) {
    try {
      process.kill(-child.pid, signal);
    } catch {
      return; // the group is gone
    }
    if (signal === "SIGTERM") Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, 500);
  }
}

/**
 * Starts tauri-driver on `port`; the apps it starts get `env` (it passes its own on). It runs
 * until `tearDown`.
 */
export async function startDriver(port, env) {
  const child = spawn("tauri-driver", ["--port", String(port), "--native-port", String(port + 1)], {
    stdio: "inherit",
    env: { ...process.env, ...env },
    // Its own process group, which `killGroup` ends whole.
    detached: true,
  });
  for (let i = 0; i < 100; i++) {
    try {
      if ((await fetch(`http://127.0.0.1:${port}/status`)).ok) {
        driverProcesses.push(child);
        return child;
      }
    } catch {
      /* not up yet */
    }
    await new Promise((r) => setTimeout(r, 100));
  }
  killGroup(child);
  throw new Error("tauri-driver did not start");
}

/** Starts the test server with `args`, its output piped, as the loopback hub `tearDown` stops. */
export function startHub(args) {
  hub = spawn(TESTSERVER, args, { stdio: ["ignore", "pipe", "inherit"] });
  return hub;
}

export async function openApp(port = DRIVER_PORT) {
  const started = performance.now();
  driver = await new Builder()
    .usingServer(`http://127.0.0.1:${port}/`)
    .withCapabilities({ browserName: "wry", "tauri:options": { application: APP } })
    .build();
  try {
    await driver.wait(async () => (await driver.executeScript("return document.body.dataset.ready")) === "true", 30000);
  } catch (e) {
    // Keep what the window showed, to tell a page that never loaded from one stuck loading.
    const state = await driver.executeScript("return document.readyState").catch((err) => String(err));
    const page = await driver.getPageSource().catch((err) => String(err));
    writeFileSync(join(SHOTS, "startup-failure.html"), `<!-- readyState: ${state} -->\n${page}`);
    await shot("startup-failure").catch(() => {});
    throw e;
  }
  return performance.now() - started;
}

/** Quits the app of the session in use, if any, and forgets the session. */
export async function closeApp() {
  await driver?.quit().catch(() => {});
  driver = undefined;
}

export async function shot(name) {
  writeFileSync(join(SHOTS, `${name}.png`), await driver.takeScreenshot(), "base64");
}

export const byTest = (id) => By.css(`[data-testid="${id}"]`);
export const find = (id, timeout = 20000) => driver.wait(until.elementLocated(byTest(id)), timeout);
export const textOf = (el) => driver.executeScript("return arguments[0].textContent.trim()", el);
export const click = (el) =>
  driver.executeScript("arguments[0].dispatchEvent(new MouseEvent('click', {bubbles: true}))", el);

/** Waits for the last turn to end and returns its status. */
export async function lastTurnEnds(timeout = 120000) {
  await driver.wait(async () => {
    const turns = await driver.findElements(byTest("turn"));
    const status = turns.length && (await turns[turns.length - 1].getAttribute("data-status"));
    return status === "finished" || status === "failed" || status === "cancelled";
  }, timeout);
  const turns = await driver.findElements(byTest("turn"));
  return turns[turns.length - 1];
}

/** `baton history … --json`: one JSON object per line. */
export function history(...args) {
  const out = execFileSync(BATON, ["history", ...args, "--json", "--db", DB], { encoding: "utf8" });
  return out.trim().split("\n").filter(Boolean).map((l) => JSON.parse(l));
}

export function requests() {
  return readFileSync(serverLog, "utf8").trim().split("\n").filter(Boolean).map((l) => JSON.parse(l));
}
