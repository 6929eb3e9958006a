// The run-command box: exec with stream: true, then the operation's frames over the
// realtime socket, stdout and stderr kept apart, ending with a typed exit line.
import { api, ApiError } from "./api";
import { BoundedConsole, type Stream } from "./console";
import { bytes } from "./format";
import type { Frame, Realtime } from "./realtime";

interface StreamMeta {
  truncated?: boolean;
  total_bytes?: number;
}

export interface OperationRecord {
  id: string;
  status: string;
  termination: string;
  exit_code: number | null;
  signal: number | null;
  stdout: string;
  stderr: string;
  output?: { stdout?: StreamMeta; stderr?: StreamMeta };
  usage?: { wall_s?: number };
  error?: { code?: string; message?: string } | null;
  children_remained?: boolean;
}

const SIGNALS: Record<number, string> = {
  1: "SIGHUP", 2: "SIGINT", 3: "SIGQUIT", 6: "SIGABRT", 9: "SIGKILL", 11: "SIGSEGV", 13: "SIGPIPE", 15: "SIGTERM",
};

/** How an operation ended, as words and a badge colour. */
export function describeEnd(op: OperationRecord): { text: string; kind: string } {
  const wall = op.usage?.wall_s !== undefined ? ` · ${op.usage.wall_s.toFixed(2)}s` : "";
  switch (op.termination) {
    case "exited":
      return { text: `exit code ${op.exit_code}${wall}`, kind: op.exit_code === 0 ? "ok" : "bad" };
    case "signaled": {
      const name = op.signal !== null ? (SIGNALS[op.signal] ?? `signal ${op.signal}`) : "a signal";
      return { text: `killed by ${name}${wall}`, kind: "bad" };
    }
    case "timeout":
      return { text: `timed out${wall}`, kind: "warn" };
    case "output_limit":
      return { text: `stopped: output limit reached${wall}`, kind: "warn" };
    default:
      return { text: `failed: ${op.error?.message ?? op.error?.code ?? "agent error"}`, kind: "bad" };
  }
}

function decodeBase64(data: string): Uint8Array {
  const raw = atob(data);
  const out = new Uint8Array(raw.length);
  for (let i = 0; i < raw.length; i += 1) out[i] = raw.charCodeAt(i);
  return out;
}

export class ExecBox {
  private decoders = { stdout: new TextDecoder(), stderr: new TextDecoder() };
  private unsubscribe: (() => void) | null = null;
  private sawFrames = false;
  private operationId = "";
  private readonly console: BoundedConsole;

  constructor(
    private readonly sandboxId: string,
    private readonly output: HTMLElement,
    private readonly status: HTMLElement,
    private readonly client: Realtime | null,
    private readonly onFinished: () => void,
    private readonly onStarted: () => void = () => {},
  ) {
    this.console = new BoundedConsole(output, () =>
      this.operationId
        ? `/sandboxes/${encodeURIComponent(this.sandboxId)}/operations/${encodeURIComponent(this.operationId)}/output.txt`
        : null,
    );
  }

  async run(command: string, timeout: number | null): Promise<void> {
    this.reset();
    this.setStatus("starting…", "running");
    const operationId = `web-${crypto.randomUUID()}`;
    this.operationId = operationId;
    let record: OperationRecord;
    try {
      record = await api<OperationRecord>(
        `/api/v1/sandboxes/${encodeURIComponent(this.sandboxId)}/exec`,
        {
          json: { command, operation_id: operationId, stream: this.client !== null, timeout },
        },
      );
    } catch (err) {
      const message = err instanceof ApiError ? err.body.message : String(err);
      this.setStatus(message, "bad");
      return;
    }
    if (record.status === "running" && this.client) {
      this.setStatus("running…", "running");
      this.onStarted();
      this.unsubscribe = this.client.operation(this.sandboxId, record.id, (f) => this.onFrame(f));
      return;
    }
    this.finish(record, true);
  }

  private reset(): void {
    this.unsubscribe?.();
    this.unsubscribe = null;
    this.sawFrames = false;
    this.decoders = { stdout: new TextDecoder(), stderr: new TextDecoder() };
    this.console.reset();
    this.output.hidden = false;
  }

  private append(stream: Stream, text: string): void {
    this.console.append(stream, text);
  }

  private onFrame(frame: Frame): void {
    if (frame.type === "exec.stdout" || frame.type === "exec.stderr") {
      const stream = frame.type === "exec.stdout" ? "stdout" : "stderr";
      this.sawFrames = true;
      this.append(stream, this.decoders[stream].decode(decodeBase64(String(frame.data)), { stream: true }));
    } else if (frame.type === "exec.gap") {
      // The view fell behind the server's replay window: the gap says what it skipped
      // (lines per stream), counted into the console's omitted lines. A gap without
      // a size (a re-subscribe whose last frame is gone) is marked where it happened.
      const lines = skippedLines(frame.skipped);
      if (lines !== null) this.console.skip(lines);
      else this.append("note", `\n[… output frames ${frame.from_seq}–${frame.to_seq} no longer kept …]\n`);
    } else if (frame.type === "exec.exit") {
      this.finish(frame.result as OperationRecord, !this.sawFrames);
    } else if (frame.type === "error" && frame.operation_id === undefined) {
      this.setStatus(String(frame.message ?? frame.code), "bad");
    }
  }

  private finish(record: OperationRecord, renderWhole: boolean): void {
    this.unsubscribe = null;
    if (renderWhole) {
      this.append("stdout", record.stdout ?? "");
      this.append("stderr", record.stderr ?? "");
    } else {
      this.append("stdout", this.decoders.stdout.decode());
      this.append("stderr", this.decoders.stderr.decode());
    }
    const end = describeEnd(record);
    const notes: string[] = [];
    for (const name of ["stdout", "stderr"] as const) {
      const meta = record.output?.[name];
      if (meta?.truncated) notes.push(`${name} truncated (${bytes(meta.total_bytes ?? 0)} in total)`);
    }
    if (record.children_remained) notes.push("background processes remained");
    if (this.console.empty) this.append("note", "(no output)");
    this.console.flush();
    this.setStatus([end.text, ...notes].join(" · "), end.kind);
    this.output.dataset.finished = record.termination;
    this.onFinished();
  }

  private setStatus(text: string, kind: string): void {
    this.status.textContent = text;
    this.status.className = `badge badge-${kind}`;
    this.status.hidden = false;
  }
}

/** The lines an exec.gap frame skipped (stdout + stderr), or null without a size. */
function skippedLines(skipped: unknown): number | null {
  if (typeof skipped !== "object" || skipped === null) return null;
  let total = 0;
  for (const name of ["stdout", "stderr"]) {
    const lines = (skipped as Record<string, { lines?: unknown } | undefined>)[name]?.lines;
    if (typeof lines !== "number") return null;
    total += lines;
  }
  return total;
}
