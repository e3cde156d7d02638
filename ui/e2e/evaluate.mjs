// The Evaluate screen and learning: an evaluation's table, chart, items and topology; the pool
// learning its workers, with a profile per worker.

import assert from "node:assert/strict";
import { By } from "selenium-webdriver";
import { byTest, click, driver, figures, find, history, shot, textOf } from "./support.mjs";

/** An evaluation from the Evaluate screen, then the pool learning its workers. */
export async function evaluateAndLearn(t) {
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
}
