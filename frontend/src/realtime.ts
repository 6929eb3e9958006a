// The page's one realtime websocket (docs/realtime.md): reconnects with backoff and
// re-subscribes every topic on reconnect, resuming operation streams after the last
// seq seen so no frame is lost or shown twice.

export type Frame = { type: string; [key: string]: unknown };
type Handler = (frame: Frame) => void;

interface Subscription {
  key: string;
  message: Record<string, unknown>;
  handler: Handler;
  lastSeq: number;
  done: boolean;
}

const MAX_BACKOFF_MS = 10_000;

export class Realtime {
  private socket: WebSocket | null = null;
  private subs = new Map<string, Subscription>();
  private backoff = 500;
  private pingTimer: number | undefined;
  private statusListeners: Array<(connected: boolean) => void> = [];
  connected = false;

  constructor(private readonly url: string) {}

  onStatus(listener: (connected: boolean) => void): void {
    this.statusListeners.push(listener);
    listener(this.connected);
  }

  /** Tenant-wide sandbox.state and image.progress events. Returns an unsubscribe function. */
  sandboxes(handler: Handler): () => void {
    return this.add("sandboxes", { type: "subscribe", topic: "sandboxes" }, handler);
  }

  /** exec.* frames of one operation, from after_seq on, ending with exec.exit. */
  operation(sandboxId: string, operationId: string, handler: Handler): () => void {
    const message = {
      type: "subscribe",
      topic: "operation",
      sandbox_id: sandboxId,
      operation_id: operationId,
    };
    return this.add(`op:${sandboxId}:${operationId}`, message, handler);
  }

  private add(key: string, message: Record<string, unknown>, handler: Handler): () => void {
    const sub: Subscription = { key, message, handler, lastSeq: -1, done: false };
    this.subs.set(key, sub);
    this.ensureOpen();
    if (this.connected) this.sendSubscribe(sub);
    return () => {
      this.subs.delete(key);
      if (this.connected && !sub.done) {
        this.send({ ...message, type: "unsubscribe" });
      }
    };
  }

  private ensureOpen(): void {
    if (this.socket) return;
    const socket = new WebSocket(this.url);
    this.socket = socket;
    socket.addEventListener("open", () => {
      this.backoff = 500;
      this.setConnected(true);
      for (const sub of this.subs.values()) if (!sub.done) this.sendSubscribe(sub);
      this.pingTimer = window.setInterval(() => this.send({ type: "ping" }), 25_000);
    });
    socket.addEventListener("message", (event) => {
      if (typeof event.data !== "string") return;
      let frame: Frame;
      try {
        frame = JSON.parse(event.data) as Frame;
      } catch {
        return;
      }
      this.dispatch(frame);
    });
    socket.addEventListener("close", (event) => {
      window.clearInterval(this.pingTimer);
      this.socket = null;
      this.setConnected(false);
      // 4401/4403: signed out or wrong origin — retrying cannot help.
      if (event.code === 4401 || event.code === 4403) return;
      window.setTimeout(() => this.ensureOpen(), this.backoff);
      this.backoff = Math.min(this.backoff * 2, MAX_BACKOFF_MS);
    });
  }

  private dispatch(frame: Frame): void {
    const type = frame.type;
    if (type.startsWith("exec.")) {
      const sub = this.subs.get(`op:${String(frame.sandbox_id)}:${String(frame.operation_id)}`);
      if (!sub) return;
      const seq = typeof frame.seq === "number" ? frame.seq : null;
      if (seq !== null) {
        if (seq <= sub.lastSeq) return; // already shown before a reconnect
        sub.lastSeq = seq;
      }
      if (type === "exec.gap" && typeof frame.to_seq === "number") sub.lastSeq = frame.to_seq;
      if (type === "exec.exit") sub.done = true;
      sub.handler(frame);
      return;
    }
    // The "subscribed" ack goes to the handler too: events before it were not delivered,
    // so a page re-reads its state then (not at "open", which leaves a gap).
    // image.progress rides the same tenant topic (docs/realtime.md): pages filter by type.
    if (
      type === "sandbox.state" ||
      type === "image.progress" ||
      (type === "subscribed" && frame.topic === "sandboxes")
    ) {
      this.subs.get("sandboxes")?.handler(frame);
      return;
    }
    if (type === "error") {
      // An error about a subscription goes to every handler; they ignore what is not theirs.
      for (const sub of this.subs.values()) sub.handler(frame);
    }
  }

  private sendSubscribe(sub: Subscription): void {
    const message = { ...sub.message };
    if (message.topic === "operation") message.after_seq = sub.lastSeq;
    this.send(message);
  }

  private send(message: Record<string, unknown>): void {
    if (this.socket && this.socket.readyState === WebSocket.OPEN) {
      this.socket.send(JSON.stringify(message));
    }
  }

  private setConnected(connected: boolean): void {
    this.connected = connected;
    for (const listener of this.statusListeners) listener(connected);
  }
}

let shared: Realtime | null = null;

/** The page's realtime client, or null when the server has no websocket endpoint. */
export function realtime(): Realtime | null {
  const url = document.body.dataset.realtimeUrl;
  if (!url) return null;
  if (!shared) {
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    shared = new Realtime(`${scheme}//${location.host}${url}`);
    // The top bar's dot says it in words too; a lost connection shows a visible
    // "Reconnecting… updates paused" until the socket is back (base.html, #live-label).
    let wasConnected = false;
    shared.onStatus((connected) => {
      document.body.classList.toggle("realtime-on", connected);
      const lost = wasConnected && !connected;
      document.body.classList.toggle("realtime-lost", lost);
      wasConnected ||= connected;
      const label = document.getElementById("live-label");
      if (label) {
        label.textContent = connected
          ? "Live updates on"
          : lost
            ? "Reconnecting… updates paused"
            : "Live updates connecting";
        label.classList.toggle("sr-only", !lost);
      }
    });
  }
  return shared;
}

export function websocketUrl(path: string): string {
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  return `${scheme}//${location.host}${path}`;
}
