// A first start, on profiles of their own: an empty profile starts on the welcome screen with
// nothing in red; a first run downloads the recommended conductor from a loopback Hugging Face hub
// (with progress, a stop and a resume), loads it and answers the first question.

import { execFileSync } from "node:child_process";
import { readFileSync, writeFileSync, mkdirSync, existsSync, symlinkSync } from "node:fs";
import { join } from "node:path";
import { test } from "node:test";
import assert from "node:assert/strict";
import {
  BATON,
  byTest,
  click,
  closeApp,
  driver,
  DRIVER_PORT,
  figures,
  find,
  lastTurnEnds,
  openApp,
  REAL_MODEL,
  serverAddress,
  shot,
  startDriver,
  startHub,
  textOf,
  wireName,
  WORK,
} from "./support.mjs";

/**
 * Registers the tests of a first start, each on a profile of its own, after the main session's
 * test: an empty profile shows the welcome screen; a first run downloads the recommended conductor
 * and answers the first question with it.
 */
export function firstRunTests() {
  test("an empty profile starts on the welcome screen, with nothing in red", async () => {
    await closeApp();
    // A first start: no pool file yet, no history.
    const profile = join(WORK, "empty-profile");
    mkdirSync(profile);
    const pool = join(profile, "pool.toml");
    await startDriver(DRIVER_PORT + 2, {
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
    await closeApp();
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
    const hub = startHub(["--hub-dir", hubDir, "--hub-chunk-delay-ms", "10"]);
    const endpoint = await new Promise((resolve, reject) => {
      let out = "";
      hub.stdout.on("data", (d) => {
        out += String(d);
        const line = out.split("\n").find((l) => l.startsWith("hub on "));
        if (line) resolve(line.split(" ")[2]);
      });
      hub.once("exit", (code) => reject(new Error(`the hub exited with ${code}`)));
    });
    await startDriver(DRIVER_PORT + 4, {
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
}

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
