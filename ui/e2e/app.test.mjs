// End-to-end tests of the built app (the release build by default, the debug-profile build
// with `scripts/e2e --debug`) in the real webview (WebKitWebDriver through tauri-driver),
// with the tiny random conductor model and a loopback provider server that requires a key.
// Run by `scripts/e2e` (which builds everything, starts Xvfb, D-Bus and a throwaway
// gnome-keyring); it passes the paths `support.mjs` reads in the environment.
//
// One session walks through what a new user does, in order, saving a screenshot of each screen
// under target/e2e/: set a key, ask, watch the answer stream, inspect the topology, review and
// edit a plan, check that untrusted HTML stays text, re-run one step with another worker,
// reopen the app and find it all again, stream a 4,000-line answer while measuring frame time
// and token to paint, and switch conversation while a run streams. A second session starts the
// app on an empty profile; a third, on a first run, downloads the recommended conductor from a
// loopback Hugging Face hub and asks the first question with it. Figures (start times, memory, token to paint, the long answer's
// frame times) go to target/e2e/figures.json.
//
// This file is the one the test runner runs; the subjects are in files of their own, which it
// runs in this order in one process, as each step carries on from the app and history the one
// before left: `settings.mjs` (keys, the Conductor screen, logs), `chat.mjs`, `evaluate.mjs`
// (evaluations and learning), `history.mjs`, `compare.mjs`, `streaming.mjs`, `local-api.mjs` and
// `first-run.mjs`. `support.mjs` holds what they share: the server, the driver sessions, helpers.

import { execFileSync } from "node:child_process";
import { readFileSync } from "node:fs";
import { test, before, after } from "node:test";
import { APP, figures, find, openApp, setUp, shot, tearDown } from "./support.mjs";
import { keyAndConductorSettings, keyKeptOutOfFilesAndLogs } from "./settings.mjs";
import { firstConversation } from "./chat.mjs";
import { evaluateAndLearn } from "./evaluate.mjs";
import { afterRestart } from "./history.mjs";
import { compareInChat } from "./compare.mjs";
import { longAndRunningAnswers } from "./streaming.mjs";
import { localApi } from "./local-api.mjs";
import { firstRunTests } from "./first-run.mjs";

before(setUp);
after(tearDown);

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

  await keyAndConductorSettings(t);
  await firstConversation(t);
  await keyKeptOutOfFilesAndLogs(t);
  await evaluateAndLearn(t);
  await afterRestart(t);
  await compareInChat(t);
  await longAndRunningAnswers(t);
  await localApi(t);
});

firstRunTests();
