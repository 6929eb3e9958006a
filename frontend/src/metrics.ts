// The sandbox page's metrics panel (docs/frontend.md "Metrics"): polls
// GET /api/v1/sandboxes/{id}/metrics every 5 s while the tab is visible and draws the
// last MAX_SAMPLES as small line charts. The server keeps a bounded history of every
// read, so the first poll asks for the last HISTORY_S (`?since=`) and a reopened page
// starts from what was sampled before it.
import type { Chart } from "chart.js";
import { ApiError, api } from "./api";
import { lineChart } from "./charts";
import { bytes } from "./format";

const MAX_SAMPLES = 360; // 30 minutes at 5 s (the server keeps as many)
const HISTORY_S = 1800;
const MIB = 1 << 20;

interface Kept {
  ts: number;
  memory_bytes: number;
  cpu_usage_ns: number;
  pids: number;
  disk_bytes: number | null;
}

interface Sample extends Kept {
  memory_limit_bytes: number;
  cpu_millis: number;
  history?: Kept[];
}

interface Point {
  label: string;
  cpuPercent: number | null; // null for the first sample: a rate needs two
  memoryMib: number;
  pids: number;
}

export function startMetrics(panel: HTMLElement, sandboxId: string): void {
  const interval = Number(panel.dataset.metricsInterval ?? "5000");
  const status = panel.querySelector<HTMLElement>("[data-metrics-status]");
  const canvases = {
    cpu: panel.querySelector<HTMLCanvasElement>('canvas[data-metric="cpu"]'),
    memory: panel.querySelector<HTMLCanvasElement>('canvas[data-metric="memory"]'),
    pids: panel.querySelector<HTMLCanvasElement>('canvas[data-metric="pids"]'),
  };
  const points: Point[] = [];
  const charts: Partial<Record<keyof typeof canvases, Chart>> = {};
  let last: Kept | null = null;
  let fromServer = 0; // points that were sampled before this page opened
  let timer: number | undefined;
  let stopped = false;
  let inflight = false;
  let leavingAt = -Infinity;

  const chart = (
    key: keyof typeof canvases,
    label: string,
    unit: string,
    shown: Point[],
    value: (p: Point) => number,
  ) => {
    const canvas = canvases[key];
    if (!canvas) return;
    const labels = shown.map((p) => p.label);
    const data = shown.map((p) => Number(value(p).toFixed(1)));
    const existing = charts[key];
    if (existing) {
      existing.data.labels = labels;
      existing.data.datasets[0].data = data;
      existing.update("none");
    } else {
      charts[key] = lineChart(canvas, { labels, unit, datasets: [{ label, data }] });
    }
    canvas.dataset.points = String(data.length);
  };

  const show = (key: string, text: string, value: number) => {
    const el = panel.querySelector<HTMLElement>(`[data-metric-value="${key}"]`);
    if (!el) return;
    el.textContent = text;
    el.dataset.value = String(value);
  };

  const add = (sample: Kept): number | null => {
    let cpu: number | null = null;
    if (last && sample.ts <= last.ts) return null; // already drawn
    if (last) {
      const used = Math.max(0, sample.cpu_usage_ns - last.cpu_usage_ns);
      cpu = (used / ((sample.ts - last.ts) * 1e9)) * 100;
    }
    last = sample;
    points.push({
      label: new Date(sample.ts * 1000).toLocaleTimeString([], { hour12: false }),
      cpuPercent: cpu,
      memoryMib: sample.memory_bytes / MIB,
      pids: sample.pids,
    });
    if (points.length > MAX_SAMPLES) points.shift();
    return cpu;
  };

  const record = (sample: Sample) => {
    const earlier = (sample.history ?? []).filter((h) => h.ts < sample.ts);
    for (const kept of earlier) add(kept);
    fromServer += earlier.length;
    const cpu = add(sample);
    // the first sample has no CPU rate: the CPU chart starts at the second
    const rated = points.filter((p) => p.cpuPercent !== null);
    chart("cpu", "CPU % of one core", "%", rated, (p) => p.cpuPercent ?? 0);
    chart("memory", "memory MiB", " MiB", points, (p) => p.memoryMib);
    chart("pids", "pids", "", points, (p) => p.pids);
    if (cpu !== null) show("cpu", `${cpu.toFixed(1)} %`, cpu);
    show(
      "memory",
      `${bytes(sample.memory_bytes)} of ${bytes(sample.memory_limit_bytes)}`,
      sample.memory_bytes,
    );
    show("pids", String(sample.pids), sample.pids);
    if (sample.disk_bytes !== null) show("disk", bytes(sample.disk_bytes), sample.disk_bytes);
    panel.dataset.samples = String(points.length);
    if (status) {
      const kept = Math.min(fromServer, points.length);
      status.textContent = `${points.length} sample${points.length === 1 ? "" : "s"}${kept ? ` (${kept} kept by the server from before this page opened)` : " since this page opened"}, every ${interval / 1000} s while it is visible.`;
    }
  };

  const poll = async () => {
    timer = undefined;
    // The header follows the sandbox's state (realtime): once it is no longer ready
    // there is nothing to read, and asking would only earn a 409.
    const state = document.querySelector<HTMLElement>("#sandbox-header [data-state]")?.dataset.state;
    if (state && state !== "ready") stopped = true;
    if (stopped || inflight || document.visibilityState !== "visible") return;
    if (performance.now() - leavingAt < 3000) {
      schedule();
      return;
    }
    inflight = true;
    try {
      // the first read also asks for what the server kept of the last HISTORY_S
      const since = last === null ? `?since=${Math.floor(Date.now() / 1000 - HISTORY_S)}` : "";
      record(
        await api<Sample>(`/api/v1/sandboxes/${encodeURIComponent(sandboxId)}/metrics${since}`),
      );
    } catch (err) {
      if (err instanceof ApiError && err.status === 409) {
        stopped = true;
        panel.dataset.unavailable = err.body.code;
        if (status) status.textContent = `No metrics: ${err.body.message}`;
        return;
      }
      if (status) status.textContent = "Could not read the metrics; retrying.";
    } finally {
      inflight = false;
    }
    schedule();
  };

  const schedule = () => {
    if (!stopped && timer === undefined && document.visibilityState === "visible") {
      timer = window.setTimeout(() => void poll(), interval);
    }
  };

  // Leaving the page (the Delete form posts and navigates): no poll may start while the
  // sandbox is being deleted underneath it.
  // A link that turns out to be a download also fires beforeunload and the page stays:
  // skip a poll for a moment rather than stop for good.
  window.addEventListener("beforeunload", () => {
    leavingAt = performance.now();
  });
  document.addEventListener("visibilitychange", () => {
    if (document.visibilityState === "visible" && timer === undefined) void poll();
    else if (document.visibilityState !== "visible" && timer !== undefined) {
      window.clearTimeout(timer);
      timer = undefined;
    }
  });
  void poll();
}
