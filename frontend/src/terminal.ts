// xterm.js over the PTY websocket (docs/realtime.md): binary frames carry terminal
// bytes both ways; JSON frames carry init, resize, signals and the exit code.
//
// A dropped connection (network, server restart, proxy timeout) is reopened with
// backoff while the status reads "Reconnecting… updates paused". The agent kills a
// session whose connection dropped, so the reopened terminal is a new shell: bash's
// PROMPT_COMMAND (below) saves the shell's exported variables and working directory
// into a file in the sandbox's /tmp at every prompt, and the first prompt of the next
// shell of the same tab sources it back. Shell (unexported) variables, functions, jobs
// and running programs do not survive (docs/frontend.md, "The terminal").
//
// Tab completes in the shell; Esc then Tab (or Shift+Tab) leaves the terminal.
import "@xterm/xterm/css/xterm.css";
import { FitAddon } from "@xterm/addon-fit";
import { Terminal } from "@xterm/xterm";
import { websocketUrl } from "./realtime";

export interface TerminalHandle {
  close(): void;
}

export type TerminalStatusKind = "ok" | "off" | "error" | "warn";

export const RECONNECTING = "Reconnecting… updates paused";
const BACKOFF_MS = [500, 1000, 2000, 4000, 8000, 15000];

/** One key per sandbox and browser tab: the reopened shell finds its saved state. */
function sessionKey(sandboxId: string): string {
  const name = `hedgerow.terminal.${sandboxId}`;
  let key = "";
  try {
    key = sessionStorage.getItem(name) ?? "";
  } catch {
    // storage disabled: a key for this page only
  }
  if (!/^[0-9a-f]{16}$/.test(key)) {
    const bytes = crypto.getRandomValues(new Uint8Array(8));
    key = Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
    try {
      sessionStorage.setItem(name, key);
    } catch {
      // as above
    }
  }
  return key;
}

/** bash runs this before each prompt: restore once per shell, save, report the cwd
 * (OSC 7) so the page knows where the shell is. Other shells ignore it. */
export function promptCommand(key: string): string {
  const file = `/tmp/.hedgerow-terminal-${key}`;
  return (
    `__hr_f=${file}; ` +
    `if [ -z "\${__hr_r-}" ]; then __hr_r=1; [ -r "$__hr_f" ] && . "$__hr_f" 2>/dev/null; fi; ` +
    `(umask 077; { export -p; printf 'cd -- %q\\n' "$PWD"; } >| "$__hr_f") 2>/dev/null; ` +
    `printf '\\033]7;file://%s%s\\007' "\${HOSTNAME-}" "$PWD"`
  );
}

export function openTerminal(
  host: HTMLElement,
  sandboxId: string,
  onStatus: (text: string, kind: TerminalStatusKind) => void,
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
  const key = sessionKey(sandboxId);

  // The shell's directory, from OSC 7 (file://host/path), shown on the element.
  term.parser.registerOscHandler(7, (data) => {
    const path = data.replace(/^file:\/\/[^/]*/, "");
    try {
      host.dataset.cwd = decodeURIComponent(path);
    } catch {
      host.dataset.cwd = path;
    }
    return true;
  });

  // Esc then Tab: let the browser move focus instead of completing in the shell.
  let escaped = false;
  term.attachCustomKeyEventHandler((event) => {
    if (event.type !== "keydown") return true;
    if (["Shift", "Control", "Alt", "Meta"].includes(event.key)) return true;
    if (event.key === "Tab" && escaped) {
      escaped = false;
      return false; // not handled by xterm: the browser's focus navigation runs
    }
    escaped = event.key === "Escape";
    return true;
  });

  const encoder = new TextEncoder();
  let socket: WebSocket | null = null;
  let closedByUser = false;
  let ended = false; // the shell exited or the server refused: no reconnect
  let attempt = 0;
  let retry: number | undefined;

  const sendJson = (message: unknown) => {
    if (socket?.readyState === WebSocket.OPEN) socket.send(JSON.stringify(message));
  };

  const connect = () => {
    retry = undefined;
    const ws = new WebSocket(
      websocketUrl(`/ws/v1/sandboxes/${encodeURIComponent(sandboxId)}/pty`),
    );
    socket = ws;
    ws.binaryType = "arraybuffer";
    let refused = false;
    ws.addEventListener("open", () => {
      ws.send(
        JSON.stringify({
          type: "pty.init",
          rows: term.rows,
          cols: term.cols,
          cmd: null,
          env: { TERM: "xterm-256color", PROMPT_COMMAND: promptCommand(key) },
          cwd: null,
        }),
      );
    });
    ws.addEventListener("message", (event) => {
      if (event.data instanceof ArrayBuffer) {
        term.write(new Uint8Array(event.data));
        return;
      }
      const frame = JSON.parse(String(event.data)) as { type: string; [k: string]: unknown };
      if (frame.type === "pty.ready") {
        attempt = 0;
        host.dataset.pid = String(frame.pid);
        onStatus(`connected · pid ${String(frame.pid)}`, "ok");
        term.focus();
      } else if (frame.type === "pty.exit") {
        ended = true;
        const code = Number(frame.code);
        const how = code < 0 ? `killed by signal ${-code}` : `exited with code ${code}`;
        term.write(`\r\n\x1b[2m[process ${how}]\x1b[0m\r\n`);
        onStatus(`session ended: ${how}`, "off");
      } else if (frame.type === "error") {
        refused = true;
        onStatus(String(frame.message ?? frame.code), "error");
      }
    });
    ws.addEventListener("close", (event) => {
      if (socket !== ws || closedByUser || ended) return;
      // 44xx: the server refused (no write scope, gone, too many terminals): final.
      if (event.code >= 4400 && event.code < 4500) {
        ended = true;
        if (!refused) onStatus(`disconnected (${event.code})`, "error");
        return;
      }
      term.write(`\r\n\x1b[2m[connection lost; reconnecting]\x1b[0m\r\n`);
      onStatus(RECONNECTING, "warn");
      const delay = BACKOFF_MS[Math.min(attempt, BACKOFF_MS.length - 1)];
      attempt += 1;
      retry = window.setTimeout(connect, delay);
    });
  };

  onStatus("connecting…", "off");
  connect();

  term.onData((data) => {
    if (socket?.readyState === WebSocket.OPEN) socket.send(encoder.encode(data));
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
      closedByUser = true;
      if (retry !== undefined) window.clearTimeout(retry);
      observer.disconnect();
      sendJson({ type: "pty.close" });
      socket?.close(1000);
      term.dispose();
      delete host.dataset.cwd;
      delete host.dataset.pid;
    },
  };
}
