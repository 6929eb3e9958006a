// xterm.js over the PTY websocket (docs/realtime.md): binary frames carry terminal
// bytes both ways; JSON frames carry init, resize, signals and the exit code.
import "@xterm/xterm/css/xterm.css";
import { FitAddon } from "@xterm/addon-fit";
import { Terminal } from "@xterm/xterm";
import { websocketUrl } from "./realtime";

export interface TerminalHandle {
  close(): void;
}

export function openTerminal(
  host: HTMLElement,
  sandboxId: string,
  onStatus: (text: string, kind: "ok" | "off" | "error") => void,
): TerminalHandle {
  const term = new Terminal({
    cursorBlink: true,
    fontFamily: '"JetBrains Mono", "DejaVu Sans Mono", Menlo, Consolas, monospace',
    fontSize: 13,
    theme: { background: "#0f1720", foreground: "#e2e8f0", cursor: "#7dd3a8" },
    scrollback: 5000,
  });
  const fit = new FitAddon();
  term.loadAddon(fit);
  term.open(host);
  fit.fit();

  const socket = new WebSocket(websocketUrl(`/ws/v1/sandboxes/${encodeURIComponent(sandboxId)}/pty`));
  socket.binaryType = "arraybuffer";
  const encoder = new TextEncoder();
  let ended = false;
  const sendJson = (message: unknown) => {
    if (socket.readyState === WebSocket.OPEN) socket.send(JSON.stringify(message));
  };
  onStatus("connecting…", "off");

  socket.addEventListener("open", () => {
    sendJson({
      type: "pty.init",
      rows: term.rows,
      cols: term.cols,
      cmd: null,
      env: { TERM: "xterm-256color" },
      cwd: null,
    });
  });
  socket.addEventListener("message", (event) => {
    if (event.data instanceof ArrayBuffer) {
      term.write(new Uint8Array(event.data));
      return;
    }
    const frame = JSON.parse(String(event.data)) as { type: string; [k: string]: unknown };
    if (frame.type === "pty.ready") {
      onStatus(`connected · pid ${String(frame.pid)}`, "ok");
      term.focus();
    } else if (frame.type === "pty.exit") {
      ended = true;
      const code = Number(frame.code);
      const how = code < 0 ? `killed by signal ${-code}` : `exited with code ${code}`;
      term.write(`\r\n\x1b[2m[process ${how}]\x1b[0m\r\n`);
      onStatus(`session ended: ${how}`, "off");
    } else if (frame.type === "error") {
      onStatus(String(frame.message ?? frame.code), "error");
    }
  });
  socket.addEventListener("close", () => {
    if (!ended) onStatus("disconnected", "off");
    ended = true;
  });

  term.onData((data) => {
    if (socket.readyState === WebSocket.OPEN) socket.send(encoder.encode(data));
  });
  term.onResize(({ rows, cols }) => sendJson({ type: "pty.resize", rows, cols }));
  const observer = new ResizeObserver(() => {
    try {
      fit.fit();
    } catch {
      // the element is hidden; nothing to fit
    }
  });
  observer.observe(host);

  return {
    close() {
      observer.disconnect();
      sendJson({ type: "pty.close" });
      socket.close(1000);
      term.dispose();
    },
  };
}
