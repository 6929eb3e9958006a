// Every page: htmx (with CSRF), local times, copy buttons, confirmations, live tables.
import "./styles.css";
import htmx from "htmx.org";
import { csrfToken } from "./api";
import { confirmDialog } from "./confirm";
import { hydrateTimes } from "./format";
import { realtime } from "./realtime";

declare global {
  interface Window {
    htmx: typeof htmx;
  }
}
window.htmx = htmx;

document.body.addEventListener("htmx:configRequest", (event) => {
  const detail = (event as CustomEvent<{ headers: Record<string, string> }>).detail;
  detail.headers["X-CSRFToken"] = csrfToken();
});

// Every swap brings new <time> elements and copy buttons into the page.
document.body.addEventListener("htmx:afterSettle", (event) => {
  hydrateTimes(event.target as ParentNode);
});
hydrateTimes();
window.setInterval(() => hydrateTimes(), 15_000);

async function copy(text: string): Promise<void> {
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    const area = document.createElement("textarea");
    area.value = text;
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
}

document.addEventListener("click", (event) => {
  const target = (event.target as Element).closest<HTMLElement>("[data-copy]");
  if (!target) return;
  event.preventDefault();
  void copy(target.dataset.copy ?? "").then(() => {
    target.classList.add("copied");
    const label = target.getAttribute("aria-label");
    target.setAttribute("aria-label", "Copied");
    window.setTimeout(() => {
      target.classList.remove("copied");
      if (label) target.setAttribute("aria-label", label);
    }, 1500);
  });
});

// <form data-confirm="Delete sb-1?"> asks in an accessible <dialog> before submitting.
document.addEventListener(
  "submit",
  (event) => {
    const form = event.target as HTMLFormElement;
    if (!form.dataset.confirm || form.dataset.confirmed === "yes") return;
    event.preventDefault();
    event.stopImmediatePropagation();
    let message = form.dataset.confirm;
    if (form.dataset.confirmCount) {
      // a bulk form: name how many it acts on ("Delete {n} sandboxes?")
      const n = document.querySelectorAll(`input[name="${form.dataset.confirmCount}"][form="${form.id}"]:checked`).length;
      message = message.replace("{n}", String(n));
    }
    void confirmDialog(message).then((yes) => {
      if (!yes) return;
      // A live table re-read while the dialog was open replaced the form (the bulk
      // delete bar lives in #sandbox-table): submit its successor, found by id, whose
      // checkboxes the re-read kept. A detached form submits nothing, silently.
      const target = form.isConnected
        ? form
        : form.id
          ? document.getElementById(form.id)
          : null;
      if (!(target instanceof HTMLFormElement)) return;
      target.dataset.confirmed = "yes";
      target.requestSubmit();
      delete target.dataset.confirmed;
    });
  },
  true,
);

// Live sandbox tables: re-read over htmx when any sandbox of the team changes state;
// without a websocket (or while it reconnects), poll.
// Swaps replace the table element, so it is looked up afresh on every refresh.
if (document.querySelector("[data-live-sandboxes]")) {
  let pending: number | undefined;
  const refresh = () => {
    window.clearTimeout(pending);
    pending = window.setTimeout(() => {
      for (const el of document.querySelectorAll<HTMLElement>("[data-live-sandboxes]")) {
        htmx.trigger(el, "refresh");
      }
    }, 150);
  };
  const client = realtime();
  let poll: number | undefined;
  const startPolling = () => {
    if (poll === undefined) poll = window.setInterval(refresh, 4000);
  };
  if (client) {
    client.sandboxes((frame) => {
      // "subscribed": events before it were missed (after a (re)connect): re-read.
      if (frame.type === "sandbox.state" || frame.type === "subscribed") refresh();
    });
    client.onStatus((connected) => {
      if (connected) {
        window.clearInterval(poll);
        poll = undefined;
        refresh(); // state events are not replayed: re-read after (re)connecting
      } else {
        startPolling();
      }
    });
  } else {
    startPolling();
  }
}

// Bulk selection in live sandbox tables: the table is re-rendered on every refresh, so
// the chosen ids live here and are re-applied after each swap.
const chosen = new Set<string>();
function applyBulk(): void {
  const items = Array.from(document.querySelectorAll<HTMLInputElement>("[data-bulk-item]"));
  for (const item of items) item.checked = chosen.has(item.value);
  const present = items.filter((i) => chosen.has(i.value)).length;
  for (const [id] of chosen.entries()) if (!items.some((i) => i.value === id)) chosen.delete(id);
  const all = document.querySelector<HTMLInputElement>("[data-bulk-all]");
  if (all) all.checked = items.length > 0 && present === items.length;
  const submit = document.querySelector<HTMLButtonElement>("[data-bulk-submit]");
  if (submit) submit.disabled = present === 0;
  const count = document.querySelector<HTMLElement>("[data-bulk-count]");
  if (count) count.textContent = present ? `${present} selected` : "";
}
document.addEventListener("change", (event) => {
  const target = event.target as HTMLInputElement;
  if (target.matches("[data-bulk-item]")) {
    if (target.checked) chosen.add(target.value);
    else chosen.delete(target.value);
  } else if (target.matches("[data-bulk-all]")) {
    for (const item of document.querySelectorAll<HTMLInputElement>("[data-bulk-item]")) {
      if (target.checked) chosen.add(item.value);
      else chosen.delete(item.value);
    }
  } else {
    return;
  }
  applyBulk();
});
document.body.addEventListener("htmx:afterSwap", applyBulk);
document.body.addEventListener("htmx:afterRequest", (event) => {
  const form = (event as CustomEvent<{ elt: Element }>).detail.elt;
  if (form instanceof HTMLFormElement && form.id === "bulk-delete") chosen.clear();
});

// A table that scrolls sideways inside its box must be reachable by keyboard (axe:
// scrollable-region-focusable): such boxes get tabindex=0, re-checked after swaps and
// on every resize (a handful of elements: cheap).
function focusableScrollers(): void {
  for (const box of document.querySelectorAll<HTMLElement>(".table-wrap")) {
    if (box.scrollWidth > box.clientWidth + 1) {
      if (!box.hasAttribute("tabindex")) box.tabIndex = 0;
    } else if (box.tabIndex === 0) {
      box.removeAttribute("tabindex");
    }
  }
}
focusableScrollers();
document.body.addEventListener("htmx:afterSettle", focusableScrollers);
window.addEventListener("resize", focusableScrollers);

// A live re-read swaps the element that had keyboard focus (a checkbox, a Delete button)
// for a fresh copy, and focus fell to <body>: the keyboard user lost their place. The
// same control in the new content gets focus back (found by id, name+value or label),
// else the swapped region itself.
let refocus: string | null = null;
function selectorFor(el: Element): string {
  if (el.id) return `#${CSS.escape(el.id)}`;
  const name = el.getAttribute("name");
  const value = el.getAttribute("value");
  if (name) return `${el.tagName.toLowerCase()}[name="${CSS.escape(name)}"]${value ? `[value="${CSS.escape(value)}"]` : ""}`;
  const label = el.getAttribute("aria-label");
  if (label) return `${el.tagName.toLowerCase()}[aria-label="${CSS.escape(label)}"]`;
  return "";
}
document.body.addEventListener("htmx:beforeSwap", (event) => {
  const target = (event as CustomEvent<{ target: Element }>).detail.target;
  const active = document.activeElement;
  refocus = active && active !== document.body && target.contains(active) ? selectorFor(active) : null;
});
document.body.addEventListener("htmx:afterSettle", (event) => {
  if (refocus === null) return;
  const wanted = refocus;
  refocus = null;
  if (document.activeElement && document.activeElement !== document.body) return;
  const target = (event as CustomEvent<{ target: HTMLElement }>).detail.target;
  const again = wanted ? document.querySelector<HTMLElement>(wanted) : null;
  if (again) {
    again.focus();
  } else if (document.contains(target)) {
    if (!target.hasAttribute("tabindex")) target.tabIndex = -1;
    target.focus();
  }
});
