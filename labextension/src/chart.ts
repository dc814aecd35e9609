import { formatBytes } from './format';
import { ISample } from './model';

const SVG_NS = 'http://www.w3.org/2000/svg';
const WIDTH = 300;
const HEIGHT = 120;
const PAD_TOP = 14;
const PAD_BOTTOM = 14;

/** The series drawn, in order; the class names carry the colours (style/base.css). */
export const SERIES: { key: 'used' | 'reserved' | 'offloaded'; label: string }[] = [
  { key: 'reserved', label: 'Reserved' },
  { key: 'used', label: 'Used' },
  { key: 'offloaded', label: 'Offloaded' }
];

function svg<K extends keyof SVGElementTagNameMap>(
  tag: K,
  attrs: Record<string, string | number>
): SVGElementTagNameMap[K] {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attrs)) {
    node.setAttribute(name, String(value));
  }
  return node;
}

/**
 * Draw the usage history as an SVG line chart: used, reserved and offloaded bytes
 * over the last `seconds` (the x axis spans them), with the budget as a dashed line. The y axis runs from 0
 * to 110% of the largest of the budget and the values.
 */
export function renderChart(history: readonly ISample[], seconds: number, now: number): SVGSVGElement {
  const root = svg('svg', {
    class: 'jp-vgpu-chart',
    viewBox: `0 0 ${WIDTH} ${HEIGHT}`,
    preserveAspectRatio: 'none',
    role: 'img'
  });
  const plotHeight = HEIGHT - PAD_TOP - PAD_BOTTOM;
  let top = 1;
  for (const s of history) {
    top = Math.max(top, s.used, s.reserved, s.offloaded, s.budget ?? 0);
  }
  top *= 1.1;
  const x = (t: number) => WIDTH - ((now - t) / seconds) * WIDTH;
  const y = (v: number) => PAD_TOP + plotHeight - (v / top) * plotHeight;

  for (const fraction of [0, 0.5, 1]) {
    const gy = PAD_TOP + plotHeight * fraction;
    root.appendChild(svg('line', { class: 'jp-vgpu-chart-grid', x1: 0, x2: WIDTH, y1: gy, y2: gy }));
  }
  const budget = history.length ? history[history.length - 1].budget : null;
  if (budget) {
    root.appendChild(
      svg('line', { class: 'jp-vgpu-chart-budget', x1: 0, x2: WIDTH, y1: y(budget), y2: y(budget) })
    );
  }
  for (const { key } of SERIES) {
    if (history.length === 0) {
      continue;
    }
    const points = history.map(s => `${x(s.time).toFixed(1)},${y(s[key]).toFixed(1)}`);
    if (history.length === 1) {
      points.unshift(`${(x(history[0].time) - 2).toFixed(1)},${y(history[0][key]).toFixed(1)}`);
    }
    root.appendChild(
      svg('polyline', { class: `jp-vgpu-chart-line jp-vgpu-series-${key}`, points: points.join(' ') })
    );
  }
  const label = svg('text', { class: 'jp-vgpu-chart-label', x: 2, y: 10 });
  label.textContent = formatBytes(top);
  root.appendChild(label);
  const span = svg('text', { class: 'jp-vgpu-chart-label', x: 2, y: HEIGHT - 2 });
  span.textContent = `last ${Math.max(1, Math.round(seconds / 60))} min`;
  root.appendChild(span);
  const nowLabel = svg('text', {
    class: 'jp-vgpu-chart-label',
    x: WIDTH - 2,
    y: HEIGHT - 2,
    'text-anchor': 'end'
  });
  nowLabel.textContent = 'now';
  root.appendChild(nowLabel);
  return root;
}
