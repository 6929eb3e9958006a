// Times in the viewer's local zone with relative ages; sizes in binary units.

const UNITS: Array<[Intl.RelativeTimeFormatUnit, number]> = [
  ["day", 86_400],
  ["hour", 3_600],
  ["minute", 60],
  ["second", 1],
];

export function relative(date: Date, now: Date = new Date()): string {
  const seconds = Math.round((date.getTime() - now.getTime()) / 1000);
  if (Math.abs(seconds) < 5) return "just now";
  const abs = Math.abs(seconds);
  for (const [unit, size] of UNITS) {
    if (abs >= size || unit === "second") {
      const value = Math.trunc(seconds / size);
      return new Intl.RelativeTimeFormat(undefined, { numeric: "auto", style: "short" }).format(
        value,
        unit,
      );
    }
  }
  return date.toLocaleString();
}

/** "58m", "2h 5m", "expired": the time left until a deadline. */
export function remaining(date: Date, now: Date = new Date()): string {
  let seconds = Math.floor((date.getTime() - now.getTime()) / 1000);
  if (seconds <= 0) return "expired";
  const days = Math.floor(seconds / 86_400);
  seconds -= days * 86_400;
  const hours = Math.floor(seconds / 3_600);
  seconds -= hours * 3_600;
  const minutes = Math.floor(seconds / 60);
  if (days) return `${days}d ${hours}h`;
  if (hours) return `${hours}h ${minutes}m`;
  if (minutes) return `${minutes}m`;
  return `${seconds}s`;
}

export function bytes(n: number): string {
  if (n < 1024) return `${n} B`;
  const units = ["KiB", "MiB", "GiB", "TiB"];
  let value = n / 1024;
  let i = 0;
  while (value >= 1024 && i < units.length - 1) {
    value /= 1024;
    i += 1;
  }
  return `${value.toFixed(value < 10 ? 1 : 0)} ${units[i]}`;
}

/** Renders every <time data-rel> / <time data-until> under root in local time. */
export function hydrateTimes(root: ParentNode = document): void {
  const now = new Date();
  for (const el of root.querySelectorAll<HTMLTimeElement>("time[datetime]")) {
    const date = new Date(el.dateTime);
    if (Number.isNaN(date.getTime())) continue;
    el.title = date.toLocaleString(undefined, { dateStyle: "medium", timeStyle: "medium" });
    if (el.dataset.until !== undefined) {
      const left = remaining(date, now);
      el.textContent = left;
      el.classList.toggle("expired", left === "expired");
    } else if (el.dataset.rel !== undefined) {
      el.textContent = relative(date, now);
    } else if (el.dataset.local !== undefined) {
      const timeStyle = el.dataset.local === "seconds" ? "medium" : "short";
      el.textContent = date.toLocaleString(undefined, { dateStyle: "medium", timeStyle });
    }
  }
}

/** Dollars, the pages' one rule (frontend/templatetags/hedgerow.py `money`): cents with
 * separators, "$0.00" for nothing, "<$0.01" under a cent. */
export function money(value: number): string {
  const sign = value < 0 ? "-" : "";
  const abs = Math.abs(value);
  if (abs > 0 && abs < 0.01) return `${sign}<$0.01`;
  return `${sign}$${abs.toLocaleString("en", { minimumFractionDigits: 2, maximumFractionDigits: 2 })}`;
}
