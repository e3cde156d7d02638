import { describe, expect, it } from "vitest";
import type { Settings } from "../bindings";
import { needsSetup } from "../state.svelte";

function settings(workers: number, conductor_configured: boolean, conductor_needed: boolean): Settings {
  const form = { workers: Array.from({ length: workers }, (_, i) => ({ name: `w${i}` })) };
  return { form, conductor_configured, conductor_needed } as unknown as Settings;
}

describe("the welcome screen", () => {
  it("shows until the pool has workers and, where it needs one, a conductor", () => {
    expect(needsSetup(null)).toBe(false);
    expect(needsSetup(settings(0, true, true))).toBe(true);
    expect(needsSetup(settings(2, false, true))).toBe(true);
    expect(needsSetup(settings(2, true, true))).toBe(false);
  });

  it("does not ask for a conductor when every question is routed (route = \"always\")", () => {
    expect(needsSetup(settings(2, false, false))).toBe(false);
    expect(needsSetup(settings(0, false, false))).toBe(true);
  });
});
