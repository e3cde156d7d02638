import { describe as suite, expect, it } from "vitest";
import type { Download } from "../bindings";
import { describe, formatBytes, formatDuration, percent } from "./downloads";

const running = (over: Partial<Extract<Download, { state: "running" }>> = {}): Download => ({
  state: "running",
  reference: "o/n:m.gguf",
  phase: "downloading",
  done: 450_000_000,
  total: 1_117_320_736,
  bytes_per_sec: 12_500_000,
  eta_secs: 53.6,
  ...over,
});

suite("downloads", () => {
  it("writes sizes as the hub lists them", () => {
    expect(formatBytes(999)).toBe("999 B");
    expect(formatBytes(1_117_320_736)).toBe("1.12 GB");
    expect(formatBytes(98_000_000)).toBe("98.0 MB");
    expect(formatBytes(250_000)).toBe("250 kB");
  });

  it("writes time left in the units a person reads", () => {
    expect(formatDuration(12.4)).toBe("12 s");
    expect(formatDuration(250)).toBe("4 min 10 s");
    expect(formatDuration(7500)).toBe("2 h 05 min");
  });

  it("says how far a download is, how fast and how long it still takes", () => {
    expect(describe(running())).toBe("450 MB of 1.12 GB, 12.5 MB/s, 54 s left");
    expect(percent(running())).toBeCloseTo(40.27, 1);
    expect(describe(running({ bytes_per_sec: 0, eta_secs: null }))).toBe("450 MB of 1.12 GB");
    expect(describe(running({ phase: "resolving", done: 0, total: 0 }))).toBe("Asking the hub about the file…");
    expect(percent(running({ total: 0 }))).toBe(0);
    expect(describe(running({ phase: "reconnecting" }))).toContain("reconnecting");
    expect(describe(running({ phase: "checking", total: 450_000_000 }))).toBe(
      "Checking the part downloaded before: 450 MB of 450 MB",
    );
  });

  it("says how a download ended", () => {
    const finished: Download = {
      state: "finished",
      reference: "o/n:m.gguf",
      path: "/m",
      size: 98_000_000,
      sha256: "ab",
      resumed_from: 40_000_000,
      cached: false,
    };
    expect(describe(finished)).toBe("98.0 MB, resumed at 40.0 MB, SHA-256 checked");
    expect(describe({ ...finished, cached: true, sha256: null })).toBe("98.0 MB, already downloaded, size checked");
    const stopped: Download = { state: "stopped", reference: "o/n:m.gguf", have: 25_000_000, size: 100_000_000 };
    expect(percent(stopped)).toBe(25);
    expect(describe(stopped)).toContain("resumes from there");
    const failed: Download = { state: "failed", reference: "o/n:m.gguf", kind: "gated", message: "set HF_TOKEN" };
    expect(describe(failed)).toBe("set HF_TOKEN");
  });
});
