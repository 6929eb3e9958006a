// A bounded, batched console for command output. Appending each frame to one text node
// (`textContent +=`) re-copies the whole output per frame and re-lays it out: 200 000
// lines took 15 s to render. Here frames are queued and rendered once per animation
// frame as new text nodes, and only the last MAX_LINES lines stay in the page (a ring):
// older ones are dropped from the top and counted in a notice, "N earlier lines omitted
// — download full output", linking to the server's download of the stored operation
// (`…/operations/<id>/output.txt`, tenancy-checked like every dashboard page: each
// stream whole up to 1 MiB, else its first and last 512 KiB with a marker between).
// The view follows the tail while it is scrolled to the bottom; scrolled up, it stays.
// Lines the server skipped because the view fell behind its replay window (an exec.gap
// frame says how many) are counted in the same notice, "… (M of them skipped while the
// view fell behind)", so the count is exact either way.

export type Stream = "stdout" | "stderr" | "note";

export const MAX_LINES = 2000;

interface Chunk {
  stream: Stream;
  text: string;
}

export class BoundedConsole {
  private queue: Chunk[] = [];
  private scheduled = false;
  private lines = 0; // newlines currently in the page
  private omitted = 0; // lines dropped from the top, or skipped
  private skipped = 0; // of them: never received (the view fell behind the server)
  private notice: HTMLElement | null = null;

  constructor(
    private readonly output: HTMLElement,
    /** Where the full stored output downloads from (null: no stored operation). */
    private readonly downloadHref: (() => string | null) | null,
    private readonly maxLines: number = MAX_LINES,
  ) {}

  reset(): void {
    this.queue = [];
    this.lines = 0;
    this.omitted = 0;
    this.skipped = 0;
    this.notice = null;
    this.output.replaceChildren();
  }

  get omittedLines(): number {
    return this.omitted;
  }

  get empty(): boolean {
    return this.queue.length === 0 && this.output.querySelector("[data-stream]") === null;
  }

  append(stream: Stream, text: string): void {
    if (!text) return;
    this.queue.push({ stream, text });
    if (!this.scheduled) {
      this.scheduled = true;
      requestAnimationFrame(() => this.flush());
    }
  }

  /** Counts lines the server skipped (never received) as omitted. */
  skip(lines: number): void {
    if (lines <= 0) return;
    this.omitted += lines;
    this.skipped += lines;
    this.showNotice();
  }

  /** Renders everything queued now (also called by the scheduler). */
  flush(): void {
    this.scheduled = false;
    if (this.queue.length === 0) return;
    const nearBottom = this.output.scrollHeight - this.output.scrollTop - this.output.clientHeight < 80;
    // merge consecutive chunks of one stream: one text node per run, not per frame
    const runs: Chunk[] = [];
    for (const chunk of this.queue) {
      const last = runs[runs.length - 1];
      if (last && last.stream === chunk.stream) last.text += chunk.text;
      else runs.push({ ...chunk });
    }
    this.queue = [];
    for (const run of runs) {
      const text = this.keepTail(run.text, run.stream);
      const last = this.output.lastElementChild as HTMLElement | null;
      if (last && last.dataset.stream === run.stream) {
        last.append(document.createTextNode(text));
      } else {
        const span = document.createElement("span");
        span.className = `stream-${run.stream}`;
        span.dataset.stream = run.stream;
        span.textContent = text;
        this.output.append(span);
      }
      this.lines += countLines(text);
    }
    this.trim();
    if (nearBottom) this.output.scrollTop = this.output.scrollHeight; // follow the tail
  }

  /** A run longer than the whole ring keeps only its last maxLines lines, and
   * everything already shown goes (it is older, and its unfinished last line would
   * otherwise be glued to the first kept one). */
  private keepTail(text: string, stream: Stream): string {
    let cut = text.length;
    for (let seen = 0; seen <= this.maxLines; seen += 1) {
      cut = text.lastIndexOf("\n", cut - 1);
      if (cut < 0) return text;
    }
    for (const span of Array.from(this.output.querySelectorAll("[data-stream]"))) {
      const shown = span.textContent ?? "";
      // an unfinished line of this stream ends in the dropped part of the run (counted
      // there); one of another stream never will
      const unfinished = !shown.endsWith("\n") && (span as HTMLElement).dataset.stream !== stream;
      this.omitted += countLines(shown) + (unfinished ? 1 : 0);
      span.remove();
    }
    this.lines = 0;
    this.omitted += countLines(text.slice(0, cut + 1));
    return text.slice(cut + 1);
  }

  /** Drops whole lines from the top until at most maxLines remain. */
  private trim(): void {
    let excess = this.lines - this.maxLines;
    while (excess > 0) {
      const first = this.output.querySelector<HTMLElement>("[data-stream]");
      if (!first) break;
      const text = first.textContent ?? "";
      let cut = -1;
      let dropped = 0;
      while (dropped < excess) {
        const next = text.indexOf("\n", cut + 1);
        if (next < 0) break;
        cut = next;
        dropped += 1;
      }
      if (cut < 0 || cut === text.length - 1) {
        first.remove(); // the whole span goes (its last line included)
        dropped = countLines(text);
      } else {
        first.textContent = text.slice(cut + 1);
      }
      this.lines -= dropped;
      this.omitted += dropped;
      excess -= dropped;
      if (dropped === 0) break;
    }
    if (this.omitted > 0) this.showNotice();
  }

  private showNotice(): void {
    if (!this.notice) {
      this.notice = document.createElement("span");
      this.notice.className = "console-omitted";
      const count = document.createElement("span");
      count.className = "console-omitted-count";
      this.notice.append(count);
      const href = this.downloadHref?.();
      if (href) {
        const link = document.createElement("a");
        link.href = href;
        link.download = "";
        link.className = "console-download";
        link.textContent = "download full output";
        this.notice.append(" — ", link);
      }
      this.notice.append("\n");
      this.output.prepend(this.notice);
    }
    const count = this.notice.querySelector(".console-omitted-count");
    if (count) {
      const skipped = this.skipped
        ? ` (${this.skipped.toLocaleString("en")} of them skipped while the view fell behind)`
        : "";
      count.textContent = `${this.omitted.toLocaleString("en")} earlier lines omitted${skipped}`;
    }
  }
}

function countLines(text: string): number {
  let n = 0;
  for (let i = text.indexOf("\n"); i >= 0; i = text.indexOf("\n", i + 1)) n += 1;
  return n;
}
