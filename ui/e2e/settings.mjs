// The Workers and Conductor screens: a key typed into the app goes to the keychain and to no file
// Baton writes (history, locks, log), the conductor's model is shown, and Open logs folder opens
// the log folder.

import { execFileSync } from "node:child_process";
import { readFileSync, existsSync, readdirSync } from "node:fs";
import { join } from "node:path";
import assert from "node:assert/strict";
import {
  click,
  driver,
  find,
  history,
  KEY,
  OPENED,
  REPLIES,
  requests,
  serverAddress,
  shot,
  textOf,
  WORK,
} from "./support.mjs";

/** A key saved on the Workers screen, and the Conductor screen's model. */
export async function keyAndConductorSettings(t) {
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
}

/** After the first runs: the key is in no file Baton wrote, and the log folder opens. */
export async function keyKeptOutOfFilesAndLogs(t) {
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
}
