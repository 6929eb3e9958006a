// Chart helpers for dashboard pages (usage, trajectories). See docs/frontend.md.
//
//   <canvas data-chart="line" data-chart-source="usage-data" aria-label="…"></canvas>
//   {{ chart_data|json_script:"usage-data" }}   ← {"labels": [...], "datasets": [{"label", "data"}]}
//
// or from TypeScript: import { lineChart } from "./charts"; lineChart(canvas, data).
import {
  BarController,
  BarElement,
  CategoryScale,
  Chart,
  type ChartConfiguration,
  Filler,
  Legend,
  LinearScale,
  LineController,
  LineElement,
  PointElement,
  Tooltip,
} from "chart.js";
import { money } from "./format";

Chart.register(
  BarController,
  BarElement,
  CategoryScale,
  Filler,
  Legend,
  LinearScale,
  LineController,
  LineElement,
  PointElement,
  Tooltip,
);

export const PALETTE = ["#2f855a", "#3182ce", "#d69e2e", "#805ad5", "#e53e3e", "#319795", "#718096"];

export interface ChartData {
  labels: string[];
  datasets: Array<{ label: string; data: number[]; color?: string }>;
  stacked?: boolean;
  unit?: string;
}

function config(kind: "line" | "bar", data: ChartData): ChartConfiguration {
  const unit = data.unit ?? "";
  const isMoney = unit.trim() === "$"; // dollars read as on the page: "$0.29", "<$0.01"
  return {
    type: kind,
    data: {
      labels: data.labels,
      datasets: data.datasets.map((d, i) => {
        const color = d.color ?? PALETTE[i % PALETTE.length];
        return {
          label: d.label,
          data: d.data,
          borderColor: color,
          backgroundColor: kind === "bar" ? color : `${color}22`,
          fill: kind === "line",
          tension: 0.25,
          pointRadius: 2,
        };
      }),
    },
    options: {
      responsive: true,
      maintainAspectRatio: false,
      interaction: { mode: "index", intersect: false },
      plugins: {
        legend: { position: "bottom", labels: { boxWidth: 12 } },
        tooltip: {
          callbacks: {
            label: (ctx) =>
              isMoney
                ? `${ctx.dataset.label}: ${money(Number(ctx.parsed.y))}`
                : `${ctx.dataset.label}: ${ctx.formattedValue}${unit}`,
          },
        },
      },
      scales: {
        x: { stacked: data.stacked ?? false, grid: { display: false } },
        y: { stacked: data.stacked ?? false, beginAtZero: true },
      },
    },
  };
}

export function lineChart(canvas: HTMLCanvasElement, data: ChartData): Chart {
  return new Chart(canvas, config("line", data));
}

export function barChart(canvas: HTMLCanvasElement, data: ChartData): Chart {
  return new Chart(canvas, config("bar", data));
}

/** Draws every <canvas data-chart> under root from its json_script source. */
export function mountCharts(root: ParentNode = document): void {
  for (const canvas of root.querySelectorAll<HTMLCanvasElement>("canvas[data-chart]")) {
    if (canvas.dataset.mounted) continue;
    const source = document.getElementById(canvas.dataset.chartSource ?? "");
    if (!source?.textContent) continue;
    const data = JSON.parse(source.textContent) as ChartData;
    (canvas.dataset.chart === "bar" ? barChart : lineChart)(canvas, data);
    canvas.dataset.mounted = "yes";
  }
}

mountCharts();
document.body.addEventListener("htmx:afterSettle", (event) => mountCharts(event.target as ParentNode));
