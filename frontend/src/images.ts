// The Images page: pull progress drawn live from image.progress events (the tenant's
// realtime topic), and the table re-read when a pull ends. Without a socket, or while
// it reconnects, the table is polled while any row is pulling.
import htmx from "htmx.org";
import { bytes } from "./format";
import { realtime, type Frame } from "./realtime";

interface Progress {
  phase: string;
  layers: number;
  bytes: number;
  total: number;
}

export function progressText(p: Progress): string {
  let text = p.phase || "queued";
  if (p.total) text += ` · ${bytes(p.bytes)} of ${bytes(p.total)}`;
  if (p.layers) text += ` · ${p.layers} layer${p.layers === 1 ? "" : "s"}`;
  return text;
}

const table = (): HTMLElement | null => document.querySelector<HTMLElement>("#images-table");

function refresh(): void {
  const el = table();
  if (el) htmx.trigger(el, "refresh");
}

// The newest progress per image: a table re-read that was already in flight when an
// event arrived renders the older value from the row, so it is drawn again after a swap.
const latest = new Map<string, Progress>();

function draw(frame: Frame): void {
  const id = String(frame.image_id ?? "");
  const row = document.querySelector<HTMLElement>(`tr[data-image-id="${CSS.escape(id)}"]`);
  if (frame.status !== "pulling") {
    latest.delete(id);
    refresh(); // ready (size, layers) or failed (the typed error): the server's row says it
    return;
  }
  const progress = frame.progress as Progress | null;
  if (progress) latest.set(id, progress);
  if (!row) {
    refresh(); // a pull started elsewhere (the API, another tab): show its row
    return;
  }
  if (progress) drawRow(row, progress);
}

function drawRow(row: HTMLElement, progress: Progress): void {
  const box = row.querySelector<HTMLElement>("[data-progress]");
  if (!box) return;
  const fill = box.querySelector<HTMLElement>(".meter-fill");
  if (fill) fill.style.width = progress.total ? `${Math.min(100, (100 * progress.bytes) / progress.total)}%` : "0%";
  const text = box.querySelector<HTMLElement>("[data-progress-text]");
  if (text) text.textContent = progressText(progress);
}

if (document.querySelector("[data-images-page]")) {
  document.body.addEventListener("htmx:afterSwap", () => {
    for (const [id, progress] of latest) {
      const row = document.querySelector<HTMLElement>(`tr[data-image-id="${CSS.escape(id)}"]`);
      if (row?.dataset.status === "pulling") drawRow(row, progress);
      else latest.delete(id);
    }
  });
  const client = realtime();
  let poll: number | undefined;
  const pulling = () => table()?.dataset.pulling === "yes";
  const startPolling = () => {
    if (poll === undefined) {
      poll = window.setInterval(() => {
        if (pulling()) refresh();
      }, 2000);
    }
  };
  if (client) {
    client.sandboxes((frame) => {
      if (frame.type === "image.progress") draw(frame);
      else if (frame.type === "subscribed") {
        refresh(); // events before it were missed
        document.querySelector<HTMLElement>("[data-images-page]")!.dataset.subscribed = "yes";
      }
    });
    client.onStatus((connected) => {
      if (connected) {
        window.clearInterval(poll);
        poll = undefined;
      } else {
        startPolling();
      }
    });
  } else {
    startPolling();
  }
}
