// The sandbox detail page: live state, terminal, run-command box, file browser.
import htmx from "htmx.org";
import { api, csrfToken } from "./api";
import { confirmDialog } from "./confirm";
import { ExecBox } from "./exec";
import { bytes } from "./format";
import { realtime } from "./realtime";
import { openTerminal, type TerminalHandle } from "./terminal";

const page = document.querySelector<HTMLElement>("[data-sandbox-page]");
if (page) setup(page);
// Chart.js only where the metrics panel is (a ready sandbox): its own chunk.
const metricsPanel = document.querySelector<HTMLElement>("#metrics[data-metrics]");
if (page && metricsPanel) {
  void import("./metrics").then((m) => m.startMetrics(metricsPanel, page.dataset.sandboxId ?? ""));
}

function setup(page: HTMLElement): void {
  const sandboxId = page.dataset.sandboxId ?? "";
  const client = realtime();
  const refreshState = () => {
    for (const el of document.querySelectorAll<HTMLElement>("[data-refresh-on-state]")) {
      htmx.trigger(el, "refresh");
    }
  };
  // A sandbox that becomes ready gains its terminal/exec/files panels, and one that
  // stops being ready loses them: crossing "ready" reloads the page.
  const follow = (state: string | undefined) => {
    if (!state || state === page.dataset.state) return;
    if (state === "ready" || page.dataset.state === "ready") {
      window.setTimeout(() => location.reload(), 300);
    }
  };
  if (client) {
    client.sandboxes((frame) => {
      if (frame.type === "sandbox.state" && frame.sandbox_id === sandboxId) {
        refreshState();
        follow(typeof frame.state === "string" ? frame.state : undefined);
      } else if (frame.type === "subscribed") {
        // State events are not replayed: a change between rendering the page and the
        // subscription (a delete that finishes while the page reloads after its POST)
        // was missed and the header said "terminating" for good. Re-read on every
        // (re)subscription.
        refreshState();
      }
    });
    document.body.addEventListener("htmx:afterSettle", () => {
      follow(document.querySelector<HTMLElement>("#sandbox-header [data-state]")?.dataset.state);
    });
  } else if (["requested", "provisioning", "terminating"].includes(page.dataset.state ?? "")) {
    window.setInterval(refreshState, 4000);
  }
  // An image pull's progress is written to the row (at most 4 times a second) but sends
  // no state event: re-read the header while the sandbox is being provisioned.
  if (["requested", "provisioning"].includes(page.dataset.state ?? "")) {
    const timer = window.setInterval(() => {
      const state = document.querySelector<HTMLElement>("#sandbox-header [data-state]")?.dataset.state;
      if (state && !["requested", "provisioning"].includes(state)) window.clearInterval(timer);
      else htmx.trigger("#sandbox-header", "refresh");
    }, 1000);
  }

  setupOperationOutput();
  setupFiles();
  setupTerminal(sandboxId);
  setupExec(sandboxId, client);
  setupUpload(sandboxId);
}

function setupTerminal(sandboxId: string): void {
  const host = document.querySelector<HTMLElement>("#terminal");
  const button = document.querySelector<HTMLButtonElement>("#terminal-toggle");
  const status = document.querySelector<HTMLElement>("#terminal-status");
  if (!host || !button || !status) return;
  let handle: TerminalHandle | null = null;
  button.addEventListener("click", () => {
    if (handle) {
      handle.close();
      handle = null;
      host.hidden = true;
      button.textContent = "Open terminal";
      status.textContent = "closed";
      status.className = "badge badge-off";
      return;
    }
    host.hidden = false;
    button.textContent = "Close terminal";
    handle = openTerminal(host, sandboxId, (text, kind) => {
      status.textContent = text;
      status.className = `badge badge-${kind}`;
    });
  });
}

function setupExec(sandboxId: string, client: ReturnType<typeof realtime>): void {
  const form = document.querySelector<HTMLFormElement>("#exec-form");
  const output = document.querySelector<HTMLElement>("#exec-output");
  const status = document.querySelector<HTMLElement>("#exec-status");
  if (!form || !output || !status) return;
  const refreshHistory = () => {
    const current = document.querySelector<HTMLElement>("#operations");
    if (current) htmx.trigger(current, "refresh");
  };
  const box = new ExecBox(
    sandboxId,
    output,
    status,
    client,
    () => {
      refreshHistory();
      button.disabled = false;
    },
    refreshHistory,
  );
  const button = form.querySelector<HTMLButtonElement>("button[type=submit]")!;
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const data = new FormData(form);
    const command = String(data.get("command") ?? "").trim();
    if (!command) return;
    const timeoutRaw = String(data.get("timeout") ?? "").trim();
    button.disabled = true;
    void box.run(command, timeoutRaw ? Number(timeoutRaw) : null).finally(() => {
      if (status.classList.contains("badge-bad")) button.disabled = false;
    });
  });
}

function setupUpload(sandboxId: string): void {
  const found = document.querySelector<HTMLFormElement>("#upload-form");
  if (!found) return;
  const form: HTMLFormElement = found;
  const input = form.querySelector<HTMLInputElement>("input[type=file]")!;
  const progress = form.querySelector<HTMLProgressElement>("progress")!;
  const message = form.querySelector<HTMLElement>(".upload-message")!;
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const file = input.files?.[0];
    if (!file) {
      message.textContent = "Choose a file first.";
      return;
    }
    const dir = currentDir();
    const path = `${dir.replace(/\/$/, "")}/${file.name}`;
    // Never replace a file silently: ask the sandbox whether the path exists first.
    void exists(sandboxId, path).then(
      async (there) => {
        if (there && !(await confirmDialog(`Replace ${path}? The file there is overwritten.`))) {
          message.textContent = "Upload cancelled.";
          return;
        }
        upload(file, path, dir);
      },
      (err: unknown) => {
        message.textContent = `Upload not started: ${err instanceof Error ? err.message : String(err)}`;
      },
    );
  });

  function upload(file: File, path: string, dir: string): void {
    const xhr = new XMLHttpRequest();
    xhr.open("PUT", `/api/v1/sandboxes/${encodeURIComponent(sandboxId)}/files?path=${encodeURIComponent(path)}`);
    xhr.setRequestHeader("X-CSRFToken", csrfToken());
    xhr.setRequestHeader("Content-Type", "application/octet-stream");
    progress.hidden = false;
    progress.value = 0;
    message.textContent = `Uploading ${file.name}…`;
    xhr.upload.addEventListener("progress", (e) => {
      if (e.lengthComputable) progress.value = e.loaded / e.total;
    });
    xhr.addEventListener("load", () => {
      if (xhr.status >= 200 && xhr.status < 300) {
        progress.value = 1;
        message.textContent = `Uploaded ${path} (${bytes(file.size)}).`;
        form.reset();
        showDir(dir); // the directory it went to, not the one the page opened on
      } else {
        let text = `Upload failed (${xhr.status})`;
        try {
          text = (JSON.parse(xhr.responseText) as { error: { message: string } }).error.message;
        } catch {
          // keep the status line
        }
        message.textContent = text;
      }
      window.setTimeout(() => (progress.hidden = true), 1200);
    });
    xhr.addEventListener("error", () => {
      message.textContent = "Upload failed: connection lost.";
      progress.hidden = true;
    });
    xhr.send(file);
  }
}

function currentDir(): string {
  return document.querySelector<HTMLElement>("[data-files-path]")?.dataset.filesPath ?? "/workspace";
}

function showDir(dir: string): void {
  const listing = document.querySelector<HTMLElement>("#files");
  const url = listing?.dataset.filesUrl;
  if (!listing || !url) return;
  void htmx.ajax("get", `${url}?path=${encodeURIComponent(dir)}`, { target: listing, swap: "innerHTML" });
}

async function exists(sandboxId: string, path: string): Promise<boolean> {
  const answer = await api<{ exists: boolean }>(
    `/sandboxes/${encodeURIComponent(sandboxId)}/files/exists?path=${encodeURIComponent(path)}`,
  );
  return answer.exists;
}

// The directory shown is in the page's URL (?path=…): a reload or a shared link opens
// the file browser there.
function setupFiles(): void {
  document.body.addEventListener("htmx:afterSwap", (event) => {
    const target = (event as CustomEvent<{ target: Element }>).detail.target;
    if (!(target instanceof HTMLElement) || target.id !== "files") return;
    const url = new URL(location.href);
    const dir = currentDir();
    if (url.searchParams.get("path") === dir) return;
    url.searchParams.set("path", dir);
    history.replaceState(history.state, "", url);
  });
}

// An operation row's "Output" button opens (and closes) the row under it, which htmx
// fills with the stored stdout/stderr on the first click.
function setupOperationOutput(): void {
  document.addEventListener("click", (event) => {
    const button = (event.target as Element).closest<HTMLButtonElement>("[data-op-toggle]");
    if (!button) return;
    const row = document.getElementById(button.getAttribute("aria-controls") ?? "");
    if (!row) return;
    const open = row.hidden;
    row.hidden = !open;
    // The label stays "Output" (its accessible name must contain the visible text);
    // aria-expanded and the pressed look say whether it is open.
    button.setAttribute("aria-expanded", String(open));
  });
}
