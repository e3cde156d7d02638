// The first conversation: a question's answer streams in and is recorded, the topology matches the
// plan, a reviewed and edited plan runs as edited with untrusted HTML kept as text, one step runs
// again with another worker, and Esc stops a plan while the conductor writes it.

import { readFileSync, writeFileSync } from "node:fs";
import assert from "node:assert/strict";
import { By, Key, until } from "selenium-webdriver";
import {
  byTest,
  click,
  driver,
  figures,
  find,
  history,
  lastTurnEnds,
  POOL,
  REPLIES,
  requests,
  serverAddress,
  shot,
  textOf,
  TIMING,
} from "./support.mjs";

/** Asks, inspects, reviews, re-runs and stops, each step on what the one before left. */
export async function firstConversation(t) {
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
      // The conductor's key comes from a variable the user never allowed to go to that server:
      // nothing is sent until they say so, and the dialog names both.
      const consent = await find("key-consent");
      assert.equal(await textOf(await find("consent-var")), "$BATON_E2E_CONDUCTOR_KEY");
      assert.equal(await textOf(await find("consent-origin")), serverAddress);
      assert.ok(
        !requests().some((r) => String(r.body.model).startsWith("conductor;")),
        "no request went to the conductor before the user allowed its key to go there",
      );
      await shot("09-key-consent-asked");
      await click(await find("consent-allow"));
      await driver.wait(async () => (await driver.findElements(byTest("key-consent"))).length === 0, 10000);
      assert.ok(consent, "the dialog was shown");
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
}
