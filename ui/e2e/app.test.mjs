// End-to-end tests of the built app (the release build by default, the debug-profile build
// with `scripts/e2e --debug`) in the real webview (WebKitWebDriver through tauri-driver),
// with the tiny random conductor model and a loopback provider server that requires a key.
// Run by `scripts/e2e` (which builds everything, starts Xvfb, D-Bus and a throwaway
// gnome-keyring); it passes the paths below in the environment.
//
// One session walks through what a new user does, in order, saving a screenshot of each screen
// under target/e2e/: set a key, ask, watch the answer stream, inspect the topology, review and
// edit a plan, check that untrusted HTML stays text, re-run one step with another worker,
// reopen the app and find it all again, stream a 4,000-line answer while measuring frame time
// and token to paint, and switch conversation while a run streams. A second session starts the
// app on an empty profile; a third, on a first run, downloads the recommended conductor from a
// loopback Hugging Face hub and asks the first question with it. Figures (start times, memory, token to paint, the long answer's
// frame times) go to target/e2e/figures.json.

import { execFileSync, spawn } from "node:child_process";
import { readFileSync, writeFileSync, mkdirSync, existsSync, readdirSync, symlinkSync } from "node:fs";
import { join } from "node:path";
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { Builder, By, Key, until } from "selenium-webdriver";

const env = (name) => {
  const v = process.env[name];
  if (!v) throw new Error(`${name} is not set; run the end-to-end tests through scripts/e2e`);
  return v;
};
const APP = env("BATON_E2E_APP");
const WORK = env("BATON_E2E_WORK");
const SHOTS = env("BATON_E2E_SHOTS");
const BATON = env("BATON_E2E_CLI");
const TESTSERVER = env("BATON_E2E_TESTSERVER");
const TINYMODEL = env("BATON_E2E_TINYMODEL");
// The real test model (SmolLM2-135M-Instruct GGUF), served by a loopback hub for the first-run download.
const REAL_MODEL = env("BATON_E2E_REAL_MODEL");

const KEY = "sk-e2e-" + Math.random().toString(36).slice(2) + "-canary";
const DB = join(WORK, "history.sqlite");
const POOL = join(WORK, "pool.toml");
// The app writes when each step's first text leaves the engine here (BATON_TIMING_LOG).
const TIMING = join(WORK, "timing.jsonl");
// What the app asked the desktop to open (see the fake xdg-open in `before`).
const OPENED = join(WORK, "opened.txt");
const REPLIES = {
  alpha: "Alpha says the answer is 42, after careful thought about the question",
  beta: "Beta agrees: the answer is **42**",
  xss: "<img src=x onerror=window.pwned=1> and <script>window.pwned=2</script> done",
};
const figures = {};

let server;
let hub;
let serverAddress;
let serverLog;
let driverProcess;
let driver;

function wireName(name) {
  // The test server reads its script from the model name; `_` stands for a space there.
  return `${name};reply=${REPLIES[name].replaceAll(" ", "_")};latency=1200`;
}

before(async () => {
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
  driverProcess = await startDriver(DRIVER_PORT, {
    PATH: `${bin}:${process.env.PATH}`,
    BATON_POOL: POOL,
    BATON_DB: DB,
    BATON_LOG_DIR: join(WORK, "logs"),
    BATON_TIMING_LOG: TIMING,
    BATON_E2E_CONDUCTOR_KEY: KEY,
  });
});

after(async () => {
  await driver?.quit().catch(() => {});
  // Each tauri-driver leads a process group with its WebKitWebDriver and the app it started:
  // the whole group goes, so no app outlives the tests (or holds their output open).
  for (const child of [driverProcess, emptyDriverProcess, firstRunDriverProcess]) {
    if (child?.exitCode === null) killGroup(child);
  }
  server?.kill();
  hub?.kill();
  writeFileSync(join(SHOTS, "figures.json"), JSON.stringify(figures, null, 2));
});

const DRIVER_PORT = 4444;
let conductorModel;
let emptyDriverProcess;
let firstRunDriverProcess;

/** Writes the pool: the tiny conductor and `workers` (name → model string) on the test server. */
function writePool(workers, maxSteps = 3) {
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

/** Starts tauri-driver on `port`; the apps it starts get `env` (it passes its own on). */
async function startDriver(port, env) {
  const child = spawn("tauri-driver", ["--port", String(port), "--native-port", String(port + 1)], {
    stdio: "inherit",
    env: { ...process.env, ...env },
    // Its own process group, which `killGroup` ends whole.
    detached: true,
  });
  for (let i = 0; i < 100; i++) {
    try {
      if ((await fetch(`http://127.0.0.1:${port}/status`)).ok) return child;
    } catch {
      /* not up yet */
    }
    await new Promise((r) => setTimeout(r, 100));
  }
  killGroup(child);
  throw new Error("tauri-driver did not start");
}

async function openApp(port = DRIVER_PORT) {
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

async function shot(name) {
  writeFileSync(join(SHOTS, `${name}.png`), await driver.takeScreenshot(), "base64");
}

const byTest = (id) => By.css(`[data-testid="${id}"]`);
const find = (id, timeout = 20000) => driver.wait(until.elementLocated(byTest(id)), timeout);
const textOf = (el) => driver.executeScript("return arguments[0].textContent.trim()", el);
const click = (el) => driver.executeScript("arguments[0].dispatchEvent(new MouseEvent('click', {bubbles: true}))", el);

/** Waits for the last turn to end and returns its status. */
async function lastTurnEnds(timeout = 120000) {
  await driver.wait(async () => {
    const turns = await driver.findElements(byTest("turn"));
    const status = turns.length && (await turns[turns.length - 1].getAttribute("data-status"));
    return status === "finished" || status === "failed" || status === "cancelled";
  }, timeout);
  const turns = await driver.findElements(byTest("turn"));
  return turns[turns.length - 1];
}

/** `baton history … --json`: one JSON object per line. */
function history(...args) {
  const out = execFileSync(BATON, ["history", ...args, "--json", "--db", DB], { encoding: "utf8" });
  return out.trim().split("\n").filter(Boolean).map((l) => JSON.parse(l));
}

function requests() {
  return readFileSync(serverLog, "utf8").trim().split("\n").filter(Boolean).map((l) => JSON.parse(l));
}

test("a new user sets a key, asks, inspects, reviews a plan, and finds it all again", async (t) => {
  figures.app = APP;
  figures.cold_start_ms = Math.round(await openApp());
  const pid = execFileSync("pgrep", ["-f", "-n", APP], { encoding: "utf8" }).trim();
  // Idle: the window is up, no model loaded, no run.
  await new Promise((r) => setTimeout(r, 1000));
  const rssMib = (p) => Number(/VmRSS:\s+(\d+)/.exec(readFileSync(`/proc/${p}/status`, "utf8"))?.[1] ?? 0) / 1024;
  figures.idle_rss_mib = Math.round(rssMib(pid));
  // WebKit renders and fetches in child processes of the app; count them too.
  const children = (p) => {
    const out = execFileSync("sh", ["-c", `pgrep -P ${p} || true`], { encoding: "utf8" }).split("\n").filter(Boolean);
    return out.flatMap((c) => [c, ...children(c)]);
  };
  const family = [pid, ...children(pid)];
  figures.idle_rss_with_webkit_mib = Math.round(family.reduce((sum, p) => sum + rssMib(p), 0));
  figures.idle_processes = family.map((p) => readFileSync(`/proc/${p}/comm`, "utf8").trim());
  await find("composer");
  await shot("01-chat-empty");

  await t.test("a key typed into the app goes to the keychain only", async () => {
    // A key is kept for the server it is sent to: the workers' test server, not OpenAI's own.
    const account = `openai:${serverAddress}/v1`;
    await click(await find("nav-workers"));
    const input = await find(`key-input-${account}`);
    await input.sendKeys(KEY);
    await click(await find(`key-save-${account}`));
    const status = await find(`key-status-${account}`);
    await driver.wait(async () => (await status.getText()).includes(KEY.slice(-4)), 10000);
    assert.equal(await input.getAttribute("value"), "", "the field is cleared once the key is stored");
    const stored = execFileSync("secret-tool", ["lookup", "service", "baton", "username", account], { encoding: "utf8" });
    assert.equal(stored, KEY);
    await shot("02-workers-and-keys");
  });

  await t.test("conductor settings show the configured model", async () => {
    await click(await find("nav-conductor"));
    assert.match(await (await find("conductor-model")).getAttribute("value"), /tiny-model/);
    await shot("03-conductor");
  });

  let firstRun;
  await t.test("a question's answer streams in, and the run is recorded", async () => {
    await click(await find("new-chat"));
    const composer = await find("composer");
    await composer.sendKeys("What is six times seven?");
    // Token to paint: when the answer's first text has been painted (two animation frames
    // after the DOM change: the first runs before that paint, the second after it).
    await driver.executeScript(`
      window.__painted = null;
      const root = document.querySelector('[data-testid="turns"]');
      const observer = new MutationObserver(() => {
        const answers = root.querySelectorAll('[data-testid="answer"]');
        const last = answers[answers.length - 1];
        if (!last || !last.textContent.trim()) return;
        observer.disconnect();
        requestAnimationFrame(() => requestAnimationFrame(() => { window.__painted = Date.now(); }));
      });
      observer.observe(root, { subtree: true, childList: true, characterData: true });
    `);
    await composer.sendKeys("\uE007"); // Enter sends
    // Streaming: the answer shows part of a reply before the run has finished.
    let partial = null;
    await driver.wait(async () => {
      const turns = await driver.findElements(byTest("turn"));
      if (!turns.length) return false;
      const status = await turns[0].getAttribute("data-status");
      const text = await (await turns[0].findElement(byTest("answer"))).getText();
      if (status === "running" && text && !Object.values(REPLIES).some((r) => text === r.replace(/\*\*/g, ""))) {
        partial = text;
      }
      return status !== "running" && status !== "idle";
    }, 180000);
    const turn = await lastTurnEnds();
    assert.equal(await turn.getAttribute("data-status"), "finished", await turn.getText());
    assert.ok(partial, "the answer was never seen part-way through");
    const answer = await (await turn.findElement(byTest("answer"))).getText();
    assert.ok(
      Object.values(REPLIES).some((r) => answer.includes(r.replace(/\*\*/g, "").slice(0, 20))),
      `the answer is one worker's reply: ${answer}`,
    );
    figures.partial_answer_seen = partial.length;
    const runs = history("list");
    assert.equal(runs.length, 1);
    firstRun = history("show", String(runs[0].id))[0];
    const lastStep = firstRun.plans[0].plan.model_id.length - 1;
    const painted = await driver.executeScript("return window.__painted");
    const emitted = readFileSync(TIMING, "utf8")
      .trim()
      .split("\n")
      .map((l) => JSON.parse(l))
      .find((t) => t.run === firstRun.run.uid && t.round === 0 && t.step === lastStep);
    assert.ok(painted && emitted, `paint ${painted}, engine ${JSON.stringify(emitted)}`);
    figures.token_to_paint_ms = painted - emitted.first_delta_unix_ms;
    assert.ok(figures.token_to_paint_ms >= 0, `painted before it was sent: ${figures.token_to_paint_ms} ms`);
    await shot("04-chat-answer");
  });

  await t.test("the topology matches the plan, and a node shows its exact output", async () => {
    const turn = await lastTurnEnds();
    const plan = firstRun.plans[0].plan;
    // Graph render in the webview: from the click to the frame after every node is drawn
    // (panel, graph building, layout and SVG).
    figures.topology_open_ms = Math.round(
      await driver.executeAsyncScript(
        `const [button, expected, done] = arguments;
         const start = performance.now();
         button.dispatchEvent(new MouseEvent("click", { bubbles: true }));
         const check = () => {
           const drawn = document.querySelectorAll('[data-testid="topology"] [data-node-id]').length;
           if (drawn >= expected) requestAnimationFrame(() => done(performance.now() - start));
           else requestAnimationFrame(check);
         };
         requestAnimationFrame(check);`,
        await turn.findElement(byTest("open-topology")),
        plan.model_id.length + 2,
      ),
    );
    figures.topology_nodes = plan.model_id.length + 2;
    await find("topology");
    const workers = firstRun.run.workers;
    const nodes = await driver.executeScript(
      `return [...document.querySelectorAll('[data-testid="topology"] [data-node-id]')].map(n => [n.dataset.nodeId, n.dataset.worker || ""])`,
    );
    const edges = await driver.executeScript(
      `return [...document.querySelectorAll('[data-testid="topology"] [data-from]')].map(e => [e.dataset.from, e.dataset.to, e.dataset.kind])`,
    );
    const steps = nodes.filter(([id]) => /^r0s\d+$/.test(id));
    assert.equal(steps.length, plan.model_id.length, JSON.stringify(nodes));
    plan.model_id.forEach((worker, i) => {
      assert.deepEqual(steps.find(([id]) => id === `r0s${i}`), [`r0s${i}`, workers[worker].name]);
    });
    const expected = plan.access_list.flatMap((access, i) =>
      (access === "all" ? [...Array(i).keys()] : access).map((j) => `r0s${j}>r0s${i}`),
    );
    const drawn = edges.filter(([, , kind]) => kind === "access").map(([a, b]) => `${a}>${b}`);
    assert.deepEqual(drawn.sort(), expected.sort());

    const last = plan.model_id.length - 1;
    const node = await driver.findElement(By.css(`[data-node-id="r0s${last}"]`));
    await click(node);
    const rendered = await driver.findElement(By.css('[data-testid="inspector"] input[type="checkbox"]'));
    await click(rendered);
    const raw = await find("inspector-output-raw");
    assert.equal(await raw.getText(), REPLIES[workers[plan.model_id[last]].name]);
    assert.equal(firstRun.steps.find((s) => s.step === last).output, REPLIES[workers[plan.model_id[last]].name]);
    await shot("05-topology");
    await click(await find("close-topology"));
  });

  await t.test("an edited plan runs as edited, and HTML in an answer stays text", async () => {
    await click(await find("review-toggle"));
    const composer = await find("composer");
    await composer.sendKeys("Now plan it for review");
    // The conductor's text shows while it writes the plan.
    await driver.executeScript(`
      window.__draftSeen = "";
      const observer = new MutationObserver(() => {
        const text = document.querySelector('[data-testid="draft-text"]')?.textContent ?? "";
        if (text.length > window.__draftSeen.length) window.__draftSeen = text;
      });
      observer.observe(document.body, { subtree: true, childList: true, characterData: true });
    `);
    await click(await find("send"));
    await find("plan-review", 120000);
    const streamed = await driver.executeScript("return window.__draftSeen");
    assert.ok(streamed.length > 0, "the conductor's text was never shown while it wrote the plan");
    await shot("06-plan-review");
    const rows = await driver.findElements(By.css('[data-testid^="plan-step-"]'));
    const last = rows.length - 1;
    const subtask = await find("plan-subtask-0");
    await subtask.clear();
    await subtask.sendKeys("EDITED: greet the user");
    await driver.executeScript(
      "const s = arguments[0]; s.value = '2'; s.dispatchEvent(new Event('change', {bubbles: true}))",
      await find(`plan-worker-${last}`),
    );
    await click(await find("plan-run"));
    const turn = await lastTurnEnds();
    assert.equal(await turn.getAttribute("data-status"), "finished", await turn.getText());
    const answer = await turn.findElement(byTest("answer"));
    assert.ok((await answer.getText()).includes("<img src=x onerror=window.pwned=1>"), await answer.getText());
    assert.ok((await answer.getText()).includes("<script>window.pwned=2</script>"));
    const live = await driver.executeScript(
      `return document.querySelectorAll('[data-testid="answer"] img, [data-testid="answer"] script, [onerror]').length`,
    );
    assert.equal(live, 0);
    assert.equal(await driver.executeScript("return window.pwned === undefined"), true);
    const runs = history("list");
    const edited = history("show", String(runs[0].id))[0];
    assert.equal(edited.plans[0].plan.subtasks[0], "EDITED: greet the user");
    assert.equal(edited.plans[0].plan.model_id[last], 2);
    assert.equal(edited.plans[0].raw, null, "a reviewed plan runs as given");
    assert.ok(
      requests().some((r) => JSON.stringify(r.body).includes("EDITED: greet the user")),
      "the edited subtask went over the wire",
    );
    await shot("07-untrusted-html-as-text");
  });

  await t.test("one step of a finished run runs again with another worker, and only what depends on it", async () => {
    const turn = await lastTurnEnds();
    const runs = history("list");
    const original = history("show", String(runs[0].id))[0];
    const plan = original.plans[0].plan;
    // The last step of the edited plan, by another of the run's workers: no step sees the last
    // one, so every other step keeps its output.
    const target = plan.model_id.length - 1;
    assert.ok(target > 0, "the edited plan has more than one step");
    const workers = original.run.workers;
    const worker = workers[(plan.model_id[target] + 1) % workers.length].name;
    const again = [target];
    const calls = requests().length;

    await click(await turn.findElement(byTest("open-topology")));
    await click(await driver.wait(until.elementLocated(By.css(`[data-node-id="r0s${target}"]`)), 10000));
    await driver.executeScript(
      "const s = arguments[0]; s.value = arguments[1]; s.dispatchEvent(new Event('change', {bubbles: true}))",
      await find("rerun-worker"),
      worker,
    );
    await click(await find("rerun-button"));
    await driver.wait(async () => (await driver.findElements(byTest("turn"))).length === 3, 10000);
    const rerun = await lastTurnEnds();
    assert.equal(await rerun.getAttribute("data-status"), "finished", await rerun.getText());
    await find("rerun-label");

    const recorded = history("show", String(history("list")[0].id))[0];
    assert.deepEqual(recorded.run.rerun_of, { run_id: original.run.uid, step: target });
    assert.equal(recorded.run.conversation_id, original.run.conversation_id);
    assert.equal(recorded.steps.find((s) => s.step === target).worker, worker);
    const kept = recorded.steps.filter((s) => s.reused_from === original.run.uid).map((s) => s.step);
    const expectedKept = plan.model_id.map((_, i) => i).filter((i) => !again.includes(i));
    assert.deepEqual(kept.sort(), expectedKept);
    assert.equal(requests().length - calls, again.length, "only the re-run step and the steps that see it were called");
    // The open graph is the re-run's, with the kept steps marked.
    const marked = await driver.executeScript(
      `return [...document.querySelectorAll('[data-testid="topology"] [data-reused]')].map(n => n.dataset.nodeId)`,
    );
    assert.deepEqual(marked.sort(), expectedKept.map((i) => `r0s${i}`).sort());
    await shot("08-rerun");
    await click(await find("close-topology"));
  });

  await t.test("Esc stops a plan while the conductor writes it, and gives the question back", async () => {
    // A conductor on the test server that takes half a minute to write its plan (the tiny
    // model is done too soon to be stopped). The app reads the pool file afresh for each run.
    const pool = readFileSync(POOL, "utf8");
    const words = "I will first look at the question closely and then split it into steps for the workers";
    const slow = `[conductor]
url = "${serverAddress}/v1"
model = "conductor;reply=${words.replaceAll(" ", "_")};latency=30000"
api_key_env = "BATON_E2E_CONDUCTOR_KEY"

`;
    writeFileSync(POOL, pool.replace(/\[conductor\][^[]*/, slow));
    try {
      const turns = (await driver.findElements(byTest("turn"))).length;
      const runs = history("list").length;
      const composer = await find("composer");
      await composer.sendKeys("A question to stop");
      await click(await find("send"));
      await driver.wait(async () => (await driver.findElements(byTest("draft-text"))).length > 0, 20000);
      assert.ok(
        requests().some((r) => String(r.body.model).startsWith("conductor;")),
        "the plan was asked of the slow conductor",
      );
      // Another screen and back: the plan is still being written, and its text still grows.
      const seen = (await textOf(await find("draft-text"))).length;
      await click(await find("nav-history"));
      await find("history-search");
      await click(await find("conversation"));
      await driver.wait(async () => (await textOf(await find("draft-text"))).length > seen, 10000);
      const pressed = performance.now();
      await composer.sendKeys(Key.ESCAPE);
      await driver.wait(async () => (await driver.findElements(byTest("plan-drafting"))).length === 0, 5000);
      figures.draft_stop_ms = Math.round(performance.now() - pressed);
      assert.equal(await composer.getAttribute("value"), "A question to stop", "the question is back in the composer");
      assert.equal((await driver.findElements(byTest("ask-error"))).length, 0, "stopping is not an error");
      assert.equal((await driver.findElements(byTest("plan-review"))).length, 0, "no plan to review");
      assert.equal((await driver.findElements(byTest("turn"))).length, turns);
      assert.equal(history("list").length, runs, "nothing ran");
      await shot("09-draft-stopped");
      await composer.clear();
    } finally {
      writeFileSync(POOL, pool);
    }
  });

  await t.test("the key is in no file Baton wrote", async () => {
    const files = readdirSync(WORK).filter((f) => /^history\.sqlite(-wal|-shm)?$/.test(f));
    assert.ok(files.includes("history.sqlite"));
    for (const file of files) {
      assert.ok(!readFileSync(join(WORK, file)).includes(KEY), `${file} contains the key`);
    }
    const locks = join(WORK, "history.sqlite.locks");
    if (existsSync(locks)) for (const f of readdirSync(locks)) assert.ok(!readFileSync(join(locks, f)).includes(KEY));
    assert.ok(requests().every((r) => r.headers.authorization === `Bearer ${KEY}`), "every call carried the key");
  });

  await t.test("Open logs folder opens the app's log folder; the log has the runs and not the key", async () => {
    await click(await find("nav-conductor"));
    await click(await find("open-logs"));
    // The desktop's opener on PATH is the test's own, which notes what it was asked to open.
    // The shell creates the file before it writes the line: wait for the line.
    await driver.wait(async () => existsSync(OPENED) && readFileSync(OPENED, "utf8").endsWith("\n"), 10000);
    const logs = join(WORK, "logs");
    assert.equal(readFileSync(OPENED, "utf8").trim(), logs);
    assert.equal(await textOf(await find("logs-note")), logs);
    // One file a day (two if the test ran over midnight).
    const files = readdirSync(logs).filter((f) => /^baton-desktop\.\d{4}-\d\d-\d\d\.log$/.test(f));
    assert.ok(files.length >= 1, `the app's log files: ${readdirSync(logs)}`);
    const log = files.map((f) => readFileSync(join(logs, f), "utf8")).join("");
    assert.match(log, /INFO .*started.*program="baton-desktop"/);
    const runs = history("list").length;
    assert.ok((log.match(/run started/g) ?? []).length >= runs, `each of the ${runs} recorded runs is logged`);
    assert.match(log, /run finished: /);
    assert.ok(!log.includes(KEY), "the log holds the key");
    // The answers are in the history, not in the log.
    assert.ok(!log.includes(REPLIES.alpha), "the log holds a worker's answer");
    await click(await find("new-chat"));
  });

  await t.test("an evaluation runs from the Evaluate screen: table, chart, a strategy's items, an item's topology", async () => {
    await click(await find("nav-evaluate"));
    const strategy = (id) => driver.findElement(By.css(`[data-testid="eval-strategy"][data-strategy="${id}"]`));
    await driver.wait(async () => (await driver.findElements(byTest("eval-strategy"))).length > 0, 10000);
    // The tiny conductor writes nonsense slowly; the workers alone are what this step checks.
    if (await (await strategy("conductor")).isSelected()) await click(await strategy("conductor"));
    const limit = await find("eval-limit");
    await limit.clear();
    await limit.sendKeys("4");
    await find("eval-suite");
    const started = Date.now();
    await click(await find("eval-run"));
    await driver.wait(async () => (await driver.findElements(By.css('[data-testid="eval-progress"], [data-testid="eval-error"]'))).length > 0, 20000);
    const refused = await driver.findElements(byTest("eval-error"));
    if (refused.length > 0) {
      await shot("13-evaluate-refused");
      assert.fail(`the evaluation did not start: ${await textOf(refused[0])}`);
    }
    // Three workers alone, the lookup router and the oracle.
    await driver.wait(async () => (await driver.findElements(byTest("eval-row"))).length === 5, 60000);
    figures.evaluate_4_items_ms = Date.now() - started;
    const rows = await driver.findElements(byTest("eval-row"));
    const names = await Promise.all(rows.map((r) => r.getAttribute("data-strategy")));
    assert.deepEqual(names, ["single:alpha", "single:beta", "single:xss", "router:lookup", "oracle"]);
    const canvas = await find("eval-chart");
    assert.ok(Number(await canvas.getAttribute("width")) > 0, "the chart is drawn");
    await shot("13-evaluate");
    await click(rows[0]);
    await driver.wait(async () => (await driver.findElements(byTest("eval-item"))).length === 4, 10000);
    await click((await driver.findElements(byTest("eval-item")))[0]);
    await find("topology");
    const past = await driver.findElements(byTest("eval-past"));
    assert.equal(past.length, 1);
    // The evaluation's runs stay out of the history's list and the chat's conversations.
    assert.ok(history("list").every((r) => !r.question.includes("Answer: <letter>")));
    await click(await find("new-chat"));
  });

  await t.test("the pool learns its workers from the Workers screen: progress, a profile per worker with n and its interval", async () => {
    await click(await find("nav-workers"));
    const limit = await find("learn-limit");
    await limit.clear();
    await limit.sendKeys("2");
    const plans = await find("learn-plans");
    await plans.clear();
    await plans.sendKeys("1");
    // Three workers on two items: six runs, each one call; and one conductor plan per item.
    await driver.wait(async () => (await textOf(await find("learning"))).includes("About 6 calls"), 10000);
    await driver.wait(async () => /and 2 conductor\s+plans \(1 per item\)/.test(await textOf(await find("learning"))), 10000);
    await click(await find("learn-run"));
    await find("learn-progress");
    // The profiles are read again when the run ends: every worker's is current then.
    await driver.wait(
      async () =>
        (await driver.findElements(By.css('[data-testid="learn-profile"][data-freshness="current"]'))).length === 3,
      60000,
    );
    const refused = await driver.findElements(byTest("learn-error"));
    assert.equal(refused.length, 0, refused.length ? await textOf(refused[0]) : "");
    // The conductor's sampled plans, scored as the workers' answers are, in a block of their own.
    const plansProfile = await find("learn-plans-profile");
    assert.match(await textOf(plansProfile), /the conductor's plans/);
    const rows = await driver.findElements(byTest("learn-row"));
    assert.ok(rows.length >= 4, `a row per worker and kind of question, and the plans': ${rows.length}`);
    for (const row of rows) assert.match(await textOf(row), /\d+ of \d+ right \(95%: \d+–\d+%\)/);
    await driver.executeScript("arguments[0].scrollIntoView()", await find("learning"));
    await shot("24-learned");
    // The learning run is in the history as an evaluation of its own, kept apart from the chat's runs.
    assert.ok(history("list").every((r) => !r.question.includes("Answer: <letter>")));
  });

  await t.test("after a restart the conversation and its runs are in the history", async () => {
    await driver.quit();
    figures.warm_start_ms = Math.round(await openApp());
    const conversation = await find("conversation");
    await driver.wait(async () => (await textOf(conversation)) === "What is six times seven?", 10000);
    await click(conversation);
    await driver.wait(async () => (await driver.findElements(byTest("turn"))).length === 3, 10000);
    await find("rerun-label");
    // The conversation's choice to review plans is in the history, not in the webview.
    assert.equal(await (await find("review-toggle")).isSelected(), true);
    await shot("10-conversation-reopened");
    await click(await find("nav-history"));
    await driver.wait(async () => (await driver.findElements(byTest("history-run"))).length === 3, 10000);
    const search = await find("history-search");
    await search.sendKeys("EDITED");
    // The edited run and its re-run share the edited subtask.
    await driver.wait(async () => (await driver.findElements(byTest("history-run"))).length === 2, 10000);
    await click(await find("history-run"));
    await find("history-detail");
    await shot("11-history");
  });

  await t.test("compare in chat: the conductor and one worker alone side by side; the mark is kept and exported", async () => {
    await click(await find("new-chat"));
    const review = await find("review-toggle");
    if (await review.isSelected()) await click(review);
    const choose = async (value) =>
      driver.executeScript(
        "const s = arguments[0]; s.value = arguments[1]; s.dispatchEvent(new Event('change', { bubbles: true }))",
        await find("compare-with"),
        value,
      );
    await choose("beta");
    assert.equal(await textOf(await find("send")), "Compare");
    const composer = await find("composer");
    await composer.sendKeys("Compare: what is six times seven?");
    await composer.sendKeys(Key.ENTER);
    await find("compared");
    // The mark appears once both runs have ended and the comparison is kept.
    const marks = await find("compare-mark", 120000);
    const alone = await driver.findElement(By.css('[data-testid="compare-alone"] [data-testid="answer"]'));
    assert.equal(await textOf(alone), "Beta agrees: the answer is 42");
    const sides = await driver.findElements(By.css('[data-testid="compared"] [data-testid="run-split"]'));
    assert.equal(sides.length, 2, "each side shows its own tokens and cost");
    await click(await marks.findElement(byTest("mark-single")));
    await driver.wait(async () => (await (await find("mark-single")).getAttribute("aria-pressed")) === "true", 5000);
    await shot("21-compare");
    await choose("");
    const out = join(SHOTS, "preferences.jsonl");
    execFileSync(BATON, ["eval", "export-preferences", "-o", out, "--db", DB]);
    const pairs = readFileSync(out, "utf8").trim().split("\n").map((l) => JSON.parse(l));
    assert.equal(pairs.length, 1);
    assert.equal(pairs[0].chosen_by, "single:beta");
    assert.deepEqual(pairs[0].chosen, [{ role: "assistant", content: REPLIES.beta }]);
    // Reopened, the conversation shows the pair side by side again, with its mark.
    await click(await find("nav-history"));
    let reopened = false;
    for (const c of await driver.findElements(byTest("conversation"))) {
      if ((await textOf(c)) === "Compare: what is six times seven?") {
        await click(c);
        reopened = true;
        // The sidebar draws again on a click: the other entries are gone.
        break;
      }
    }
    assert.ok(reopened, "the compared question's conversation is in the sidebar");
    await driver.wait(async () => (await driver.findElements(byTest("compared"))).length === 1, 10000);
    assert.equal(await (await find("mark-single")).getAttribute("aria-pressed"), "true");
    // Each worker's record over the history is on its card.
    await click(await find("nav-workers"));
    // Read again on each try: the card draws anew when its record arrives.
    const recordText = async () => textOf(await find("worker-record-1")).catch(() => "");
    await driver.wait(async () => /^In the history: \d+ calls/.test(await recordText()), 10000).catch(() => {});
    assert.match(await recordText(), /^In the history: \d+ calls/);
    await shot("22-worker-records");
    await click(await find("new-chat"));
  });

  let longConversation;
  await t.test("a 4,000-line answer at 200 deltas a second keeps frame time and token to paint flat", async () => {
    // One worker that streams a long markdown answer (paragraphs, lists, tables, code with and
    // without a language) one line per delta, on a schedule: line i leaves the server i × 5 ms
    // after line 0. One step, so that answer is the chat's answer. BATON_E2E_LONG_LINES
    // measures another length at the same rate.
    const lines = Number(process.env.BATON_E2E_LONG_LINES ?? 4000);
    const latency = lines * 5;
    writePool({ long: `long;lines=${lines};latency=${latency}` }, 1);
    try {
      await click(await find("new-chat"));
      await driver.wait(async () => (await driver.findElements(byTest("turn"))).length === 0, 10000);
      const composer = await find("composer");
      await composer.sendKeys("Write a long answer");
      await driver.executeScript(MEASURE_STREAM);
      await composer.sendKeys(Key.ENTER);
      // A renderer whose cost grows with the answer falls far behind a 20 s stream. Wait long
      // (BATON_E2E_LONG_WAIT_MIN minutes, 30 by default) so that its figures are measured too;
      // if the answer is still not all painted by then, the figures say how far it got.
      const waitMin = Number(process.env.BATON_E2E_LONG_WAIT_MIN ?? 30);
      const painting = Date.now();
      const done = await driver
        .wait(async () => await driver.executeScript("return window.__stream.done"), waitMin * 60 * 1000)
        .then(
          () => true,
          () => false,
        );
      const { frames, painted } = await driver.executeScript("return window.__stream");

      const run = history("list")[0];
      const recorded = history("show", String(run.id))[0];
      longConversation = recorded.run.conversation_id;
      const answer = recorded.run.answer;
      assert.equal(answer.split("\n").length - 1, lines, "the whole answer was recorded");
      // When line 0 left the engine (the app's timing trace); line i left the server
      // i × latency / lines later.
      const emitted = readFileSync(TIMING, "utf8")
        .trim()
        .split("\n")
        .map((l) => JSON.parse(l))
        .find((e) => e.run === recorded.run.uid && e.round === 0 && e.step === 0);
      assert.ok(emitted, "the timing trace has the answer's first delta");
      // The raw measurements, to look at beyond the percentiles.
      writeFileSync(
        join(SHOTS, "long-answer.json"),
        JSON.stringify({ lines, latency, first_delta_unix_ms: emitted.first_delta_unix_ms, frames, painted }),
      );
      const spacing = latency / lines;
      const marked = answer
        .split("\n")
        .map((text, i) => (text.includes(`(line ${i})`) ? i : -1))
        .filter((i) => i >= 0);
      const shown = marked.filter((i) => typeof painted[i] === "number");
      const reached = shown.length ? shown[shown.length - 1] : -1;
      const toPaint = (i) => painted[i] - (emitted.first_delta_unix_ms + i * spacing);
      // The first and the last tenth of the answer (of what was painted, if not all of it was).
      const head = (i) => i < lines / 10;
      const tail = (i) => i > reached - lines / 10 && i <= reached;
      const figure = (part) => ({
        lines: [marked.find(part), reached >= 0 && part(reached) ? reached : marked.findLast(part)],
        frame_p95_ms: round1(p95(frames.filter(([, line]) => part(line)).map(([dt]) => dt))),
        token_to_paint_p95_ms: round1(p95(shown.filter(part).map(toPaint))),
        frames: frames.filter(([, line]) => part(line)).length,
      });
      const start = figure(head);
      const end = figure(tail);
      figures.long_answer = {
        lines,
        deltas_per_s: (lines * 1000) / latency,
        painted_to_line: reached,
        all_painted: done,
        ...(done ? {} : { gave_up_after_min: Math.round((Date.now() - painting) / 60000) }),
        start,
        end,
      };
      console.log("long answer:", JSON.stringify(figures.long_answer));
      if (!done) {
        const [status, tail] = await driver.executeScript(
          "const a = [...document.querySelectorAll('[data-testid=answer]')].at(-1);" +
            "return [a?.closest('[data-testid=turn]')?.dataset.status, a?.textContent.slice(-300)]",
        );
        assert.fail(
          `after ${waitMin} minutes the answer was painted up to line ${reached} of ${lines}; ` +
            `the turn is ${status}, its answer ends ${JSON.stringify(tail)}`,
        );
      }
      assert.deepEqual(
        marked.filter((i) => typeof painted[i] !== "number"),
        [],
        "every line of the answer was painted",
      );
      const turn = await lastTurnEnds();
      assert.equal(await turn.getAttribute("data-status"), "finished", await turn.getText());
      // Flat means the end is at most twice the start. A frame at 60 Hz is 16.7 ms, and a line
      // is painted at the earliest in the frame after it arrives, so up to one frame of frame
      // time and two of token to paint are what an idle machine shows anyway: below that, a
      // doubled figure is timer noise, not a renderer slowing down.
      const FRAME = 1000 / 60;
      assert.ok(start.frame_p95_ms !== null && end.frame_p95_ms !== null, "frames were drawn while the answer streamed");
      assert.ok(
        end.frame_p95_ms <= 2 * Math.max(start.frame_p95_ms, FRAME),
        `frame time p95 grew from ${start.frame_p95_ms} ms to ${end.frame_p95_ms} ms`,
      );
      assert.ok(
        end.token_to_paint_p95_ms <= 2 * Math.max(start.token_to_paint_p95_ms, 2 * FRAME),
        `token to paint p95 grew from ${start.token_to_paint_p95_ms} ms to ${end.token_to_paint_p95_ms} ms`,
      );
      await shot("12-long-answer");
    } finally {
      writePool(Object.fromEntries(Object.keys(REPLIES).map((name) => [name, wireName(name)])));
    }
  });

  await t.test("switching conversation while a run streams shows each conversation's own turns and choices", async () => {
    assert.ok(longConversation, "the long answer's conversation");
    const choices = () =>
      Object.fromEntries(
        execFileSync(BATON, ["history", "list", "--conversations", "--json", "--db", DB], { encoding: "utf8" })
          .trim()
          .split("\n")
          .map((l) => JSON.parse(l))
          .map((c) => [c.id, { title: c.title, workers: c.workers, review: c.review }]),
      );
    const a = longConversation;
    const b = Number(Object.entries(choices()).find(([, c]) => c.title === "What is six times seven?")[0]);
    const questionsOf = (id) =>
      history("list")
        .filter((r) => r.conversation_id === id)
        .sort((x, y) => x.id - y.id)
        .map((r) => r.question);
    const shown = async () =>
      Promise.all((await driver.findElements(byTest("turn-question"))).map((q) => textOf(q)));
    /** Waits until the chat shows exactly `id`'s turns (a run is recorded from its start). */
    const showsTurnsOf = async (id) => {
      const expected = questionsOf(id);
      await driver.wait(async () => JSON.stringify(await shown()) === JSON.stringify(expected), 10000).catch(() => {});
      assert.deepEqual(await shown(), expected, `the turns of conversation ${id}`);
    };
    const open = async (title) => {
      for (const c of await driver.findElements(byTest("conversation"))) {
        if ((await textOf(c)) === title) return click(c);
      }
      throw new Error(`no conversation "${title}" in the sidebar`);
    };
    const worker = async (name) => {
      await click(await find("pick-workers"));
      const box = await driver.wait(
        until.elementLocated(
          By.xpath(`//div[contains(@class, "popover")]//label[starts-with(normalize-space(.), "${name} ")]/input`),
        ),
        5000,
      );
      await click(box);
      await click(await find("pick-workers"));
    };
    const lastAnswer = async () => {
      const answers = await driver.findElements(byTest("answer"));
      return textOf(answers[answers.length - 1]);
    };

    // A 20 s stream from one worker, and a quick one.
    writePool({ slow: "slow;lines=400;latency=20000", alpha: wireName("alpha") }, 1);
    try {
      // A: the long answer's conversation, asked again with the slow worker only.
      await open("Write a long answer");
      await showsTurnsOf(a);
      // The pool file changed outside the app: it reads it again when its window is focused.
      await driver.executeScript("window.dispatchEvent(new Event('focus'))");
      await click(await find("pick-workers"));
      await driver.wait(
        until.elementLocated(By.xpath(`//div[contains(@class, "popover")]//label[starts-with(normalize-space(.), "slow ")]`)),
        10000,
      );
      await click(await find("pick-workers"));
      await worker("alpha");
      await driver.wait(async () => JSON.stringify(choices()[a].workers) === '["slow"]', 10000).catch(() => {});
      assert.deepEqual(choices()[a].workers, ["slow"], "A's choice is saved");
      const composer = await find("composer");
      await composer.sendKeys("Stream it slowly");
      await composer.sendKeys(Key.ENTER);
      await driver.wait(async () => newestLine(await lastAnswer()) >= 20, 120000);

      // B while A's run streams: B's turns and choices, and no Stop for a run that is not here.
      await open("What is six times seven?");
      await showsTurnsOf(b);
      assert.equal(await (await find("review-toggle")).isSelected(), true, "B reviews its plans");
      assert.match(await textOf(await find("pick-workers")), /^Workers: all/);
      assert.equal((await driver.findElements(byTest("stop"))).length, 0, "Stop belongs to A's chat");
      await shot("13-other-conversation-during-a-run");
      // A choice made here is B's, and A's stays.
      await worker("slow");
      await driver.wait(async () => JSON.stringify(choices()[b].workers) === '["alpha"]', 10000).catch(() => {});
      assert.deepEqual(choices()[b], { title: "What is six times seven?", workers: ["alpha"], review: true });
      assert.deepEqual(choices()[a], { title: "Write a long answer", workers: ["slow"], review: false });

      // Back in A: the run is there, still streaming, with A's choices.
      await open("Write a long answer");
      await showsTurnsOf(a);
      assert.equal((await shown()).at(-1), "Stream it slowly");
      const seen = await lastAnswer();
      await driver.wait(async () => (await lastAnswer()).length > seen.length, 10000);
      const turns = await driver.findElements(byTest("turn"));
      assert.equal(await turns[turns.length - 1].getAttribute("data-status"), "running");
      assert.equal(await (await find("review-toggle")).isSelected(), false, "A does not review its plans");
      assert.match(await textOf(await find("pick-workers")), /^Workers: 1 of 2/);
      const turn = await lastTurnEnds();
      assert.equal(await turn.getAttribute("data-status"), "finished", await turn.getText());
      await showsTurnsOf(a);
      assert.match(await lastAnswer(), /\(line 39\d\)/);
      await shot("14-back-to-the-running-conversation");
    } catch (error) {
      await shot("failed-switching-conversation").catch(() => {});
      throw error;
    } finally {
      writePool(Object.fromEntries(Object.keys(REPLIES).map((name) => [name, wireName(name)])));
    }
  });

  await t.test("a stopped answer keeps the text it had: in the chat, reopened, and in the inspector", async () => {
    writePool({ slow: "slow;lines=400;latency=20000" }, 1);
    const answerOf = async (turn) => textOf(await turn.findElement(byTest("answer")));
    try {
      await click(await find("new-chat"));
      await driver.wait(async () => (await driver.findElements(byTest("turn"))).length === 0, 10000);
      const composer = await find("composer");
      await composer.sendKeys("Stop this one");
      await composer.sendKeys(Key.ENTER);
      await driver.wait(async () => {
        const turns = await driver.findElements(byTest("turn"));
        return turns.length === 1 && newestLine(await answerOf(turns[0])) >= 20;
      }, 120000);
      await composer.sendKeys(Key.ESCAPE);
      const turn = await lastTurnEnds();
      assert.equal(await turn.getAttribute("data-status"), "cancelled");
      const partial = newestLine(await answerOf(turn));
      assert.ok(partial >= 20 && partial < 390, `the answer stopped part-way: line ${partial}`);
      await find("run-stopped");

      const recorded = history("show", String(history("list")[0].id))[0];
      assert.equal(recorded.run.status, "cancelled");
      const step = recorded.steps.find((s) => s.round === 0 && s.step === 0);
      assert.equal(step.status, "cancelled");
      assert.ok(newestLine(step.output) >= partial, "the history has at least the text shown");

      // Reopened from the history: the same text, marked as stopped.
      const open = async (title) => {
        for (const c of await driver.findElements(byTest("conversation"))) {
          if ((await textOf(c)) === title) return click(c);
        }
        throw new Error(`no conversation "${title}" in the sidebar`);
      };
      await open("What is six times seven?");
      await driver.wait(async () => (await driver.findElements(byTest("turn"))).length === 3, 10000);
      await open("Stop this one");
      await driver.wait(async () => {
        const turns = await driver.findElements(byTest("turn"));
        return turns.length === 1 && (await turns[0].getAttribute("data-status")) === "cancelled";
      }, 10000);
      const reopened = (await driver.findElements(byTest("turn")))[0];
      assert.equal(newestLine(await answerOf(reopened)), newestLine(step.output));
      await reopened.findElement(byTest("run-stopped"));

      // The inspector shows the step as stopped, with its text.
      await click(await reopened.findElement(byTest("open-topology")));
      await click(await driver.wait(until.elementLocated(By.css('[data-node-id="r0s0"]')), 10000));
      assert.equal(await textOf(await find("inspector-status")), "stopped");
      await find("inspector-stopped");
      assert.equal(newestLine(await textOf(await find("inspector-output"))), newestLine(step.output));
      const node = await driver.findElement(By.css('[data-node-id="r0s0"]'));
      assert.equal(await node.getAttribute("data-status"), "cancelled");
      await shot("15-stopped-answer");
      await click(await find("close-topology"));
    } finally {
      writePool(Object.fromEntries(Object.keys(REPLIES).map((name) => [name, wireName(name)])));
    }
  });

  await t.test("the Local API: switched on, it answers an OpenAI client, and the run opens in the history", async () => {
    await click(await find("nav-local-api"));
    const port = await find("local-api-port");
    await port.clear();
    await port.sendKeys("0"); // any free port
    await click(await find("local-api-on"));
    const url = await textOf(await find("local-api-url", 60000));
    assert.match(url, /^http:\/\/127\.0\.0\.1:\d+\/v1$/);
    assert.match(readFileSync(POOL, "utf8"), /\[serve\][^[]*app = true/, "the switch is kept in the pool file");
    assert.equal((await driver.findElements(byTest("local-api-unsaved"))).length, 0, "what was saved is not unsaved");
    await click(await find("local-api-show-token"));
    const token = await textOf(await find("local-api-token"));
    assert.match(token, /^[0-9a-f]{64}$/);
    const ask = (auth) =>
      fetch(`${url}/chat/completions`, {
        method: "POST",
        headers: { "content-type": "application/json", ...(auth ? { authorization: `Bearer ${auth}` } : {}) },
        body: JSON.stringify({ model: "baton/alpha", messages: [{ role: "user", content: "Served: what is six times seven?" }] }),
      });
    assert.equal((await ask(null)).status, 401, "no token, no answer");
    const answered = await ask(token);
    assert.equal(answered.status, 200);
    const body = await answered.json();
    assert.equal(body.choices[0].message.content, REPLIES.alpha);
    assert.ok(!JSON.stringify(body).includes(KEY), "the provider key is in no response");
    const counts = await find("local-api-figures");
    await driver.wait(async () => /^2 requests/.test(await textOf(counts)), 10000);
    await shot("23-local-api");
    // The served run is in the history like any other, with its topology.
    await click(await find("nav-history"));
    const search = await find("history-search");
    await search.sendKeys("Served");
    await driver.wait(async () => (await driver.findElements(byTest("history-run"))).length === 1, 10000);
    await click(await find("history-run"));
    await find("history-detail");
    await find("topology");
    assert.equal(history("list").filter((r) => r.question.startsWith("Served:")).length, 1);
    // Off again: the port is closed, and the pool file says so.
    await click(await find("nav-local-api"));
    await click(await find("local-api-off"));
    await driver.wait(async () => (await driver.findElements(byTest("local-api-url"))).length === 0, 10000);
    await assert.rejects(fetch(`${url}/models`), "the port is closed");
    assert.match(readFileSync(POOL, "utf8"), /app = false/);
    await click(await find("new-chat"));
  });
});

test("an empty profile starts on the welcome screen, with nothing in red", async () => {
  await driver?.quit().catch(() => {});
  driver = undefined;
  // A first start: no pool file yet, no history.
  const profile = join(WORK, "empty-profile");
  mkdirSync(profile);
  const pool = join(profile, "pool.toml");
  emptyDriverProcess = await startDriver(DRIVER_PORT + 2, {
    BATON_POOL: pool,
    BATON_DB: join(profile, "history.sqlite"),
    BATON_LOG_DIR: join(profile, "logs"),
  });
  await openApp(DRIVER_PORT + 2);
  await find("welcome");
  await find("welcome-choose-model");
  // The conductor models for this computer are offered, one of them recommended.
  await find("recommended");
  assert.deepEqual(await driver.executeScript(RED_TEXT), [], "text shown in red, or in a box marked as a problem");
  assert.equal(existsSync(pool), false, "showing the welcome screen writes no pool file");
  await shot("16-empty-profile");
});

test("first run: the recommended conductor downloads with progress, loads, and answers the first question", async () => {
  // The empty profile's app again, now with a loopback Hugging Face hub that serves the real
  // test model (SmolLM2-135M, 98 MB) under the name of the model Baton recommends here.
  await driver?.quit().catch(() => {});
  driver = undefined;
  const profile = join(WORK, "first-run");
  mkdirSync(profile);
  const pool = join(profile, "pool.toml");
  const models = join(profile, "models");
  const catalog = execFileSync(BATON, ["models", "catalog", "--json"], {
    encoding: "utf8",
    env: { ...process.env, BATON_MODELS_DIR: models },
  });
  const recommended = catalog.trim().split("\n").map((l) => JSON.parse(l)).find((l) => l.recommended).model;
  const colon = recommended.reference.indexOf(":");
  const [repo, file] = [recommended.reference.slice(0, colon), recommended.reference.slice(colon + 1)];
  const hubDir = join(profile, "hub");
  mkdirSync(join(hubDir, repo), { recursive: true });
  symlinkSync(REAL_MODEL, join(hubDir, repo, file));
  // A pause per 64 KiB chunk, so the download lasts long enough to watch its progress.
  hub = spawn(TESTSERVER, ["--hub-dir", hubDir, "--hub-chunk-delay-ms", "10"], { stdio: ["ignore", "pipe", "inherit"] });
  const endpoint = await new Promise((resolve, reject) => {
    let out = "";
    hub.stdout.on("data", (d) => {
      out += String(d);
      const line = out.split("\n").find((l) => l.startsWith("hub on "));
      if (line) resolve(line.split(" ")[2]);
    });
    hub.once("exit", (code) => reject(new Error(`the hub exited with ${code}`)));
  });
  firstRunDriverProcess = await startDriver(DRIVER_PORT + 4, {
    BATON_POOL: pool,
    BATON_DB: join(profile, "history.sqlite"),
    BATON_LOG_DIR: join(profile, "logs"),
    BATON_MODELS_DIR: models,
    HF_ENDPOINT: endpoint,
  });
  await openApp(DRIVER_PORT + 4);
  await find("welcome");
  const card = await find(`model-${recommended.id}`);
  await card.findElement(byTest("recommended"));
  await click(await card.findElement(byTest("download-model")));

  // Bytes, speed and time left while it downloads.
  const status = async () => textOf(await card.findElement(byTest("download-status")));
  await driver.wait(async () => / of [\d.]+ MB, [\d.]+ [kMG]?B\/s, .+ left$/.test(await status().catch(() => "")), 60000);
  const progress = await status();
  await shot("17-first-run-download");
  // Stopped half way, it keeps what it has; the same button then resumes from there.
  await click(await card.findElement(byTest("stop-download")));
  await driver.wait(async () => /^Stopped at /.test(await status().catch(() => "")), 20000);
  const resume = await driver.wait(async () => {
    const button = (await card.findElements(byTest("download-model")))[0];
    return button && /^Resume \(/.test(await textOf(button)) ? button : null;
  }, 20000);
  await click(resume);
  // Checked, saved as the conductor and loaded.
  await driver.wait(async () => (await card.findElements(byTest("is-conductor"))).length === 1, 120000);
  assert.match(await status(), /^[\d.]+ MB, resumed at [\d.]+ [kMG]?B, SHA-256 checked$/);
  const saved = readFileSync(pool, "utf8");
  const path = /model = "([^"]+)"/.exec(saved)?.[1];
  assert.ok(path?.startsWith(join(models, `models--${repo.replace("/", "--")}`, "snapshots")), saved);
  assert.equal(readFileSync(path).length, readFileSync(REAL_MODEL).length);
  figures.first_run_download = { model: recommended.reference, progress_seen: progress, finished: await status() };
  // No workers yet: nothing in red, the conductor loads on the first question.
  assert.deepEqual(await driver.executeScript(RED_TEXT), [], "text shown in red, or in a box marked as a problem");
  await shot("18-first-run-downloaded");

  // Workers are the next step of the welcome screen (the main session covers that screen); one
  // on the test server here, then the first question.
  writeFileSync(
    pool,
    `max_steps = 1

[conductor]
model = "${path}"
device = "cpu"
max_reasoning_chars = 40
max_subtask_chars = 60

[[worker]]
name = "alpha"
provider = "openai"
model = "${wireName("alpha")}"
base_url = "${serverAddress}/v1"
description = "answers questions"
`,
  );
  await click(await find("new-chat"));
  const composer = await find("composer");
  await composer.sendKeys("What is six times seven?");
  await click(await find("send"));
  const turn = await lastTurnEnds(240000);
  assert.equal(await turn.getAttribute("data-status"), "finished", await turn.getText());
  assert.ok((await textOf(await turn.findElement(byTest("answer")))).includes("Alpha says the answer is 42"));
  await shot("19-first-run-answer");

  // The Conductor screen: what the build runs on, where the conductor runs, the memory it took,
  // and how fast its plan ran.
  await click(await find("nav-conductor"));
  assert.equal(await textOf(await find("build-device")), "This build of Baton runs local models on the CPU.");
  const running = await driver.wait(async () => {
    const el = (await driver.findElements(byTest("conductor-figures")))[0];
    const text = el ? (await textOf(el)).replace(/\s+/g, " ") : "";
    return /Last plan: \d+ prompt tokens \(\d+ from the cache\) at \d+ tokens\/s, \d+ tokens written at [\d.]+ tokens\/s/.test(text)
      ? text
      : null;
  }, 15000);
  assert.match(running, /^Running on cpu, [\d.]+ [kMG]?B of memory, loaded in [\d.]+ s\./);
  figures.first_run_conductor = running;
  await shot("20-first-run-conductor");
});

/** The highest `(line I)` mark in a long answer's text (the test server writes them); -1 for none. */
const newestLine = (text) => Math.max(-1, ...[...text.matchAll(/\(line (\d+)\)/g)].map((m) => Number(m[1])));

/** The nearest-rank 95th percentile; null for no values (no frame fell in a window). */
function p95(values) {
  if (values.length === 0) return null;
  const sorted = [...values].sort((x, y) => x - y);
  return sorted[Math.ceil(0.95 * sorted.length) - 1];
}

const round1 = (x) => (x === null ? null : Math.round(x * 10) / 10);

// Runs in the page while the long answer streams. Every animation frame it notes the frame's
// length and the newest line the answer shows (from the `(line I)` marks the test server
// writes); a line first seen in one frame was painted by the next frame, which stamps it. Only
// the answer's last blocks are read: reading the whole answer every frame would cost as much as
// the rendering being measured.
const MEASURE_STREAM = `
  const stream = (window.__stream = { frames: [], painted: [], done: false });
  const MARK = /\\(line (\\d+)\\)/g;
  let newest = -1;
  let pending = null;
  let last = null;
  const newestShown = (answer) => {
    for (let el = answer.lastElementChild, k = 0; el && k < 3; el = el.previousElementSibling, k++) {
      let best = -1;
      for (const m of el.textContent.matchAll(MARK)) best = Math.max(best, Number(m[1]));
      if (best >= 0) return best;
    }
    return -1;
  };
  const frame = (time) => {
    const now = Date.now();
    if (pending) {
      for (let i = pending[0]; i <= pending[1]; i++) stream.painted[i] = now;
      pending = null;
    }
    if (last !== null && newest >= 0) stream.frames.push([time - last, newest]);
    last = time;
    const answers = document.querySelectorAll('[data-testid="answer"]');
    const answer = answers[answers.length - 1];
    const seen = answer ? newestShown(answer) : -1;
    if (seen > newest) {
      pending = [newest + 1, seen];
      newest = seen;
    }
    const status = answer?.closest('[data-testid="turn"]')?.dataset.status;
    if (newest >= 0 && !pending && status !== "running" && status !== "idle") {
      stream.done = true;
      return;
    }
    requestAnimationFrame(frame);
  };
  requestAnimationFrame(frame);
`;

// Text the user would read as an error: shown in the danger colour, or inside a box marked as
// a problem (a red border around plain text).
const RED_TEXT = `
  const probe = document.createElement("span");
  probe.style.color = "var(--danger)";
  document.body.append(probe);
  const danger = getComputedStyle(probe).color;
  probe.remove();
  const shown = (el) => el.getClientRects().length > 0;
  const found = [];
  for (const el of document.querySelectorAll("body *")) {
    if (!shown(el)) continue;
    const own = [...el.childNodes].filter((n) => n.nodeType === Node.TEXT_NODE).map((n) => n.textContent).join("").trim();
    if (own && getComputedStyle(el).color === danger) found.push(own.slice(0, 200));
  }
  for (const el of document.querySelectorAll(".bad, .error")) {
    if (shown(el) && el.textContent.trim()) found.push(el.textContent.trim().slice(0, 200));
  }
  return found;
`;
