// The Local API screen: switched on, it answers an OpenAI client, and the served run opens in the
// history; switched off, its port is closed.

import { readFileSync } from "node:fs";
import assert from "node:assert/strict";
import { byTest, click, driver, find, history, KEY, POOL, REPLIES, shot, textOf } from "./support.mjs";

/** The Local API on, asked, found in the history, and off again. */
export async function localApi(t) {
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
}
