// Answers while they stream: a 4,000-line answer keeps frame time and token to paint flat,
// switching conversation while a run streams shows each conversation's own turns and choices,
// and a stopped answer keeps the text it had.

import { execFileSync } from "node:child_process";
import { readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import assert from "node:assert/strict";
import { By, Key, until } from "selenium-webdriver";
import {
  BATON,
  byTest,
  click,
  DB,
  driver,
  figures,
  find,
  history,
  lastTurnEnds,
  REPLIES,
  shot,
  SHOTS,
  textOf,
  TIMING,
  wireName,
  writePool,
} from "./support.mjs";

/** The long answer, then a conversation switch during a run, then a stopped answer. */
export async function longAndRunningAnswers(t) {
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
}

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
