// The history after a restart: the conversation, its runs and its choices are found again, and
// the History screen searches them.

import assert from "node:assert/strict";
import { byTest, click, driver, figures, find, openApp, shot, textOf } from "./support.mjs";

/** Restarts the app and finds the first conversation again. */
export async function afterRestart(t) {
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
}
