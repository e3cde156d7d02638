// Graph render cost at 5 and 50 nodes: building the graph from a run and laying it out (the
// work done when a plan arrives; text deltas do neither). `npx vitest bench --run`.
import { bench, describe } from "vitest";
import type { RunEvent, WorkerInfo } from "../bindings";
import { applyEvent, emptyTopology, graphOf, layout, type Topology } from "./topology";

const workers: WorkerInfo[] = [0, 1, 2].map((index) => ({
  index,
  name: `w${index}`,
  provider: "openai",
  model: "m",
  description: null,
}));

/** A run of `rounds` five-step rounds, each nested under the previous round's last step. */
function run(rounds: number): Topology {
  const t = applyEvent(emptyTopology(), { type: "run_started", run_id: "r", question: "q", workers });
  for (let r = 0; r < rounds; r++) {
    const parent = r === 0 ? undefined : { round: r - 1, step: 4 };
    const model_id = [0, 1, 2, 0, r + 1 < rounds ? workers.length : 1];
    const event: RunEvent = {
      type: "plan_ready",
      round: r,
      depth: r,
      parent,
      plan: { model_id, subtasks: model_id.map((_, i) => `step ${i}`), access_list: [[], [0], "all", [1, 2], "all"] },
    };
    applyEvent(t, event);
  }
  return t;
}

const small = run(1); // 1 plan node, 5 steps, the answer: 7 nodes
const deep = run(3); // the default recursion depth cap (2): 3 rounds, 19 nodes
const large = run(8); // 8 rounds: 48 plan and step nodes, the answer

describe("topology", () => {
  bench(`graph + layout, ${graphOf(small).nodes.length} nodes`, () => {
    layout(graphOf(small));
  });
  bench(`graph + layout, ${graphOf(deep).nodes.length} nodes`, () => {
    layout(graphOf(deep));
  });
  bench(`graph + layout, ${graphOf(large).nodes.length} nodes`, () => {
    layout(graphOf(large));
  });
});
