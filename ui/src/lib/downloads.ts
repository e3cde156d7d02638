// What the model picker says about a download: sizes as the hub shows them (decimal units),
// speed, time left and how far it is.
import type { Download } from "../bindings";

/** Bytes in decimal units with three significant figures, as the hub lists file sizes. */
export function formatBytes(bytes: number): string {
  const units = ["B", "kB", "MB", "GB", "TB"];
  let value = bytes;
  let unit = 0;
  while (value >= 1000 && unit < units.length - 1) {
    value /= 1000;
    unit += 1;
  }
  if (unit === 0) return `${bytes} B`;
  const digits = value >= 100 ? 0 : value >= 10 ? 1 : 2;
  return `${value.toFixed(digits)} ${units[unit]}`;
}

/** "2 h 05 min", "4 min 10 s", "12 s". */
export function formatDuration(seconds: number): string {
  const s = Math.max(0, Math.round(seconds));
  if (s >= 3600) return `${Math.floor(s / 3600)} h ${String(Math.floor((s % 3600) / 60)).padStart(2, "0")} min`;
  if (s >= 60) return `${Math.floor(s / 60)} min ${String(s % 60).padStart(2, "0")} s`;
  return `${s} s`;
}

/** Percent done, 0 to 100 (0 while the size is not known). */
export function percent(d: Download): number {
  if (d.state === "finished") return 100;
  if (d.state === "running") return d.total > 0 ? Math.min(100, (100 * d.done) / d.total) : 0;
  if (d.state === "stopped") return d.size > 0 ? Math.min(100, (100 * d.have) / d.size) : 0;
  return 0;
}

/** One line for a download's state: what it is doing, how far, how fast, how long still. */
export function describe(d: Download): string {
  switch (d.state) {
    case "running": {
      if (d.phase === "resolving") return "Asking the hub about the file…";
      const far = d.total > 0 ? `${formatBytes(d.done)} of ${formatBytes(d.total)}` : formatBytes(d.done);
      if (d.phase === "checking") return `Checking the part downloaded before: ${far}`;
      if (d.phase === "reconnecting") return `The connection dropped at ${far}; reconnecting…`;
      const speed = d.bytes_per_sec > 0 ? `, ${formatBytes(d.bytes_per_sec)}/s` : "";
      const eta = d.eta_secs !== null ? `, ${formatDuration(d.eta_secs)} left` : "";
      return `${far}${speed}${eta}`;
    }
    case "finished": {
      const how = d.cached
        ? "already downloaded"
        : d.resumed_from > 0
          ? `resumed at ${formatBytes(d.resumed_from)}`
          : "downloaded";
      const check = d.sha256 ? "SHA-256 checked" : "size checked";
      return `${formatBytes(d.size)}, ${how}, ${check}`;
    }
    case "stopped":
      return `Stopped at ${formatBytes(d.have)} of ${formatBytes(d.size)}; downloading it again resumes from there`;
    case "failed":
      return d.message;
  }
}

/** The id a download is started (and stopped) with. */
export function downloadId(reference: string): string {
  return `download:${reference}`;
}
