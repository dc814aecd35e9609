import { Widget } from '@lumino/widgets';

import { renderChart, SERIES } from './chart';
import { h } from './dom';
import { IKernelUsage, IUsage } from './contracts';
import {
  computeShareText,
  formatBytes,
  formatPair,
  formatPercent,
  formatRatio,
  formatSeconds
} from './format';
import { vgpuIcon } from './icon';
import { UsageModel } from './model';

/** Above this fraction of the budget the usage is shown as a warning. */
export const WARN_FRACTION = 0.9;

/**
 * The sidebar panel: the slice, a meter of used memory against the budget, a chart
 * of the last minutes and a table of the kernels.
 */
export class UsagePanel extends Widget {
  constructor(model: UsageModel) {
    super();
    this.model = model;
    this.id = 'jupyter-vgpu-panel';
    this.addClass('jp-vgpu-panel');
    this.title.icon = vgpuIcon;
    this.title.caption = 'vGPU usage';
    this.model.changed.connect(this._render, this);
    this._render();
  }

  readonly model: UsageModel;

  dispose(): void {
    this.model.changed.disconnect(this._render, this);
    super.dispose();
  }

  private _render(): void {
    const usage = this.model.usage;
    const body = h('div', { class: 'jp-vgpu-body' });
    body.appendChild(h('header', { class: 'jp-vgpu-header' }, h('h2', {}, 'vGPU usage')));
    if (!usage) {
      body.appendChild(this._waiting());
    } else {
      if (!usage.slice) {
        body.appendChild(
          h(
            'div',
            { class: 'jp-vgpu-notice', 'data-state': 'no-slice' },
            'No vGPU slice: this server was started without one, so no budget applies.'
          )
        );
      } else if (usage.simulated) {
        body.appendChild(
          h(
            'div',
            { class: 'jp-vgpu-notice', 'data-state': 'simulated' },
            "Simulated GPU: usage counts the kernels' tensors."
          )
        );
      }
      if (usage.pressure) {
        body.appendChild(
          h(
            'div',
            { class: 'jp-vgpu-notice jp-mod-warn', 'data-state': 'pressure' },
            'The GPU is short of memory: idle tensors are being offloaded.'
          )
        );
      }
      if (usage.slice) {
        body.appendChild(this._slice(usage));
        body.appendChild(this._meter(usage));
      }
      body.appendChild(this._chart());
      body.appendChild(this._kernels(usage.kernels));
    }
    body.appendChild(this._footer());
    this.node.replaceChildren(body);
  }

  private _waiting(): HTMLElement {
    let text = 'Waiting for the first usage sample…';
    if (this.model.connection === 'error') {
      text = `The vGPU server extension does not answer (${this.model.error ?? 'no answer'}).`;
    } else if (this.model.error) {
      text = `Cannot show vGPU usage: ${this.model.error}.`;
    }
    return h('div', { class: 'jp-vgpu-notice', 'data-state': this.model.connection }, text);
  }

  private _slice(usage: IUsage): HTMLElement {
    const s = usage.slice!;
    // a slice of several cards has its budget and request on each card
    const indices = [s.gpu_index, ...(s.more_gpus ?? []).map(card => card.index)];
    const each = indices.length > 1 ? ' on each card' : '';
    const simulated = s.simulated && !/simulated/i.test(s.gpu_name) ? ' (simulated)' : '';
    const rows: [string, string][] = [
      [indices.length > 1 ? 'GPUs' : 'GPU', `${indices.join(' + ')}: ${s.gpu_name}${simulated}`],
      ['Isolation', s.isolation],
      ['Memory limit', `${formatBytes(s.memory_limit)}${each}`],
      ['Guaranteed', `${formatBytes(s.memory_request)}${each}`],
      ['Compute share', computeShareText(s)],
      ['Priority', String(s.priority)],
      ['Placement', s.placement],
      ['Overcommit', `${s.overcommit_ratio}×`]
    ];
    const cards = usage.gpu ? [usage.gpu, ...(usage.more_gpus ?? [])] : [];
    for (const card of cards) {
      if (card.memory_used !== null) {
        const label = cards.length > 1 ? `Whole GPU ${card.index}` : 'Whole GPU';
        rows.push([label, `${formatPair(card.memory_used, card.memory_total)}`]);
      }
    }
    if (usage.node) {
      // the host memory the node's kernels hold for their GPU memory (paused data, pinned
      // memory kept warm for a next pause), and its disk tier (the node arbiter's figures)
      rows.push(['Node host memory', `${formatPair(usage.node.host_used, usage.node.host_limit)} held`]);
      rows.push(['Node disk tier', formatBytes(usage.node.disk_used)]);
    }
    return h(
      'dl',
      { class: 'jp-vgpu-slice' },
      ...rows.flatMap(([k, v]) => [h('dt', {}, k), h('dd', { title: v }, v)])
    );
  }

  private _meter(usage: IUsage): HTMLElement {
    const limit = usage.slice!.memory_limit;
    const t = usage.totals;
    const fraction = limit ? t.used / limit : 0;
    const width = (v: number) => `${Math.min(100, (100 * v) / Math.max(limit, 1)).toFixed(2)}%`;
    const warn = fraction > WARN_FRACTION;
    return h(
      'section',
      { class: `jp-vgpu-meter${warn ? ' jp-mod-warn' : ''}` },
      h(
        'div',
        { class: 'jp-vgpu-meter-text' },
        h('span', { class: 'jp-vgpu-used', 'data-bytes': String(t.used) }, formatPair(t.used, limit)),
        h('span', { class: 'jp-vgpu-meter-percent' }, formatPercent(fraction))
      ),
      h(
        'div',
        { class: 'jp-vgpu-meter-track', role: 'meter', 'aria-valuenow': String(t.used) },
        h('div', { class: 'jp-vgpu-meter-reserved', style: `width: ${width(t.reserved)}` }),
        h('div', { class: 'jp-vgpu-meter-used', style: `width: ${width(t.used)}` }),
        h('div', {
          class: 'jp-vgpu-meter-request',
          title: `${formatBytes(usage.slice!.memory_request)} guaranteed`,
          style: `left: calc(${width(usage.slice!.memory_request)} - 1px)`
        })
      ),
      h(
        'div',
        { class: 'jp-vgpu-meter-sub' },
        `Reserved ${formatBytes(t.reserved)} · Offloaded ${formatBytes(t.offloaded)}` +
          (t.offloaded_compressed ? ` (${formatBytes(t.offloaded_compressed)} compressed)` : '')
      )
    );
  }

  private _chart(): HTMLElement {
    const history = this.model.history;
    const now = history.length ? history[history.length - 1].time : Date.now() / 1000;
    const legend = h(
      'div',
      { class: 'jp-vgpu-legend' },
      ...SERIES.map(({ key, label }) =>
        h('span', { class: `jp-vgpu-legend-item jp-vgpu-series-${key}` }, h('i', {}), label)
      ),
      h('span', { class: 'jp-vgpu-legend-item jp-vgpu-series-budget' }, h('i', {}), 'Budget')
    );
    const section = h('section', { class: 'jp-vgpu-history' }, h('h3', {}, 'Last minutes'));
    const first = history.length ? history[0].time : now;
    const span = Math.min(this.model.historySeconds, Math.max(60, now - first));
    section.appendChild(renderChart(history, span, now));
    section.appendChild(legend);
    return section;
  }

  private _kernels(kernels: IKernelUsage[]): HTMLElement {
    const section = h('section', { class: 'jp-vgpu-kernels' }, h('h3', {}, 'Kernels'));
    if (!kernels.length) {
      section.appendChild(h('div', { class: 'jp-vgpu-empty' }, 'No running kernels.'));
      return section;
    }
    const head = h(
      'tr',
      {},
      h('th', { class: 'jp-vgpu-num' }, 'Memory'),
      h('th', { class: 'jp-vgpu-num' }, 'Offloaded'),
      h('th', { class: 'jp-vgpu-num', title: 'Raw / compressed bytes of what was offloaded' }, 'Ratio')
    );
    const bodies = kernels.map(k =>
      h(
        'tbody',
        { 'data-kernel-id': k.id, class: 'jp-vgpu-kernel' },
        h(
          'tr',
          {},
          h(
            'td',
            {
              class: 'jp-vgpu-name',
              colspan: '3',
              title: `${k.name} (${k.execution_state}, pid ${k.pid ?? '—'})`
            },
            h('span', { class: `jp-vgpu-state jp-vgpu-state-${k.execution_state}` }),
            k.name
          )
        ),
        h(
          'tr',
          { class: 'jp-vgpu-kernel-figures' },
          h('td', { class: 'jp-vgpu-num jp-vgpu-kernel-used', 'data-bytes': String(k.used) }, formatBytes(k.used)),
          h('td', { class: 'jp-vgpu-num' }, formatBytes(k.offloaded)),
          h('td', { class: 'jp-vgpu-num' }, formatRatio(k.ratio))
        ),
        ...this._kernelDetails(k)
      )
    );
    section.appendChild(h('table', { class: 'jp-vgpu-table' }, h('thead', {}, head), ...bodies));
    return section;
  }

  /** The arbiter's figures of a kernel, when it reports them (null fields are left out), and
   * why it cannot be paused, when it cannot. */
  private _kernelDetails(k: IKernelUsage): HTMLElement[] {
    const parts: string[] = [];
    if (k.state) {
      parts.push(k.tier ? `${k.state} (tier: ${k.tier})` : k.state);
    }
    if (k.host_bytes !== null && k.host_bytes !== undefined && k.host_bytes > 0) {
      parts.push(`${formatBytes(k.host_bytes)} in host memory`);
    }
    if (k.disk_bytes !== null && k.disk_bytes !== undefined && k.disk_bytes > 0) {
      parts.push(`${formatBytes(k.disk_bytes)} on disk`);
    }
    if (k.last_pause_seconds !== null && k.last_pause_seconds !== undefined) {
      parts.push(`pause ${formatSeconds(k.last_pause_seconds)}`);
    }
    if (k.last_resume_seconds !== null && k.last_resume_seconds !== undefined) {
      parts.push(`resume ${formatSeconds(k.last_resume_seconds)}`);
    }
    if (k.codec) {
      parts.push(k.codec);
    }
    if (k.report_error) {
      parts.push(k.report_error);
    }
    if (k.unpausable_bytes) {
      parts.push(`${formatBytes(k.unpausable_bytes)} cannot be paused`);
    }
    const rows: HTMLElement[] = [];
    if (parts.length) {
      rows.push(
        h(
          'tr',
          {
            class: 'jp-vgpu-kernel-details',
            'data-state': k.state ?? undefined,
            'data-tier': k.tier ?? undefined
          },
          h('td', { colspan: '3' }, parts.join(' · '))
        )
      );
    }
    if (k.between_cells) {
      // code of the user's that runs between cells: it keeps nothing on the card
      rows.push(
        h(
          'tr',
          { class: 'jp-vgpu-kernel-note', 'data-between-cells': 'true' },
          h(
            'td',
            { colspan: '3' },
            `Runs between cells: ${k.between_cells}; its GPU calls bring this kernel back when it is away`
          )
        )
      );
    }
    if (k.pausable === false && k.not_pausable) {
      // why this kernel is not paused, and what happens instead (suspended, or kept on the GPU)
      rows.push(
        h(
          'tr',
          { class: 'jp-vgpu-kernel-note', 'data-pausable': 'false' },
          h('td', { colspan: '3' }, `Not pausable: ${k.not_pausable}`)
        )
      );
    }
    return rows;
  }

  private _footer(): HTMLElement {
    const labels = {
      connecting: 'Connecting…',
      stream: 'Live',
      polling: 'Polling every 2 s',
      error: 'Disconnected'
    };
    const c = this.model.connection;
    let label = labels[c];
    const at = this.model.usage?.timestamp;
    if (c === 'error' && at) {
      // the figures above stay on screen: say how old they are
      label += `: the figures above are from ${new Date(at * 1000).toLocaleTimeString()}`;
    }
    return h('footer', { class: `jp-vgpu-footer jp-vgpu-connection-${c}` }, h('i', {}), label);
  }
}
