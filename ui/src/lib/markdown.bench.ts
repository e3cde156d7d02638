// What one streamed delta costs to render, near the start of a 4,000-line answer and near its
// end: rendering the whole text again on each delta (what the chat did before
// `StreamingMarkdown`) against rendering incrementally. Each iteration appends the next line, as
// a stream does, so the figures are per delta. Run with `npx vitest bench --run` in ui/.
//
// The answer is built like the test server's `lines=N` answer (crates/baton-testserver
// `long_markdown`): paragraphs, nested lists, tables, and fenced code with and without a
// language, so highlight.js has blocks to guess.
import { bench, describe } from "vitest";
import { renderMarkdown, StreamingMarkdown } from "./markdown";

function longMarkdown(n: number): string[] {
  const lines: string[] = [];
  for (let block = 0; lines.length < n; block++) {
    const at = (k: number) => `(line ${lines.length + k})`;
    const add = (...more: string[]) => lines.push(...more);
    switch (block % 6) {
      case 0:
        add(
          `Part ${block} ${at(0)} explains **why step ${block} matters** and how \`value_${block}\` is`,
          `computed from the previous part ${at(1)} with *care*, then checked twice.`,
          `The result is kept for the next part ${at(2)}.`,
        );
        break;
      case 1:
        add(
          `- first point of part ${block} ${at(0)}`,
          `- second point, with \`inline code\` ${at(1)}`,
          `  - a nested detail ${at(2)}`,
          `- third point, **in bold** ${at(3)}`,
        );
        break;
      case 2:
        add(
          "```python",
          `def part_${block}(values):  # ${at(1)}`,
          `    total = sum(v * ${block} for v in values)  # ${at(2)}`,
          `    return {"part": ${block}, "total": total}  # ${at(3)}`,
          "```",
        );
        break;
      case 3:
        add(
          `| part | value | note ${at(0)} |`,
          "|---:|---|---|",
          `| ${block} | ${block * 7} | first row ${at(2)} |`,
          `| ${block + 1} | ${block * 7 + 3} | second row ${at(3)} |`,
        );
        break;
      case 4:
        add(
          "```",
          `let total_${block} = values.iter().map(|v| v * ${block}).sum::<i64>(); // ${at(1)}`,
          `if total_${block} > 100 { println!("large: {}", total_${block}); } // ${at(2)}`,
          `SELECT part, value FROM parts WHERE part = ${block}; -- ${at(3)}`,
          "```",
        );
        break;
      default:
        add(
          `1. check the input of part ${block} ${at(0)}`,
          `2. run the step and compare with part ${Math.max(block - 1, 0)} ${at(1)}`,
          `3. write the result down ${at(2)}`,
        );
    }
    lines.push("");
  }
  return lines.slice(0, n).map((l) => `${l}\n`);
}

const LINES = longMarkdown(4000);
/** The text after `n` deltas (one line each). */
const upTo = (n: number) => LINES.slice(0, n).join("");

// Exactly `iterations` runs, none for warm-up: each run is the next delta of one stream.
const exactly = (iterations: number) => ({ iterations, time: 0, warmupIterations: 0, warmupTime: 0 });

/** One delta per run, from line `from` on, through a renderer that has seen the lines before. */
function streamed(from: number) {
  const renderer = new StreamingMarkdown();
  renderer.update(upTo(from));
  let n = from;
  return () => void renderer.update(upTo(++n));
}

function whole(from: number) {
  let n = from;
  return () => void renderMarkdown(upTo(++n));
}

describe("one delta of a 4,000-line answer", () => {
  bench("incremental, lines 100-400", streamed(100), exactly(300));
  bench("incremental, lines 3600-3900", streamed(3600), exactly(300));
  bench("whole text each delta, lines 100-150", whole(100), exactly(50));
  bench("whole text each delta, lines 3600-3650", whole(3600), exactly(50));
});
