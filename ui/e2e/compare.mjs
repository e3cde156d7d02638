// Compare in chat: the conductor and one worker alone side by side; the mark is kept, exported as
// a preference pair, shown again when the conversation is reopened, and counted on the worker's card.

import { execFileSync } from "node:child_process";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import assert from "node:assert/strict";
import { By, Key } from "selenium-webdriver";
import { BATON, byTest, click, DB, driver, find, REPLIES, shot, SHOTS, textOf } from "./support.mjs";

/** A compared question, marked, exported and reopened. */
export async function compareInChat(t) {
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
}
