import { Widget } from '@lumino/widgets';

import { formatPair } from './format';
import { UsageModel } from './model';
import { WARN_FRACTION } from './widget';

/**
 * The status-bar item `vGPU 3.1 / 8.0 GiB`, in the warning style above 90% of the
 * budget; clicking it calls `onClick` (the plugin opens the panel).
 */
export class UsageIndicator extends Widget {
  constructor(model: UsageModel, onClick: () => void) {
    super({ node: document.createElement('div') });
    this.model = model;
    this.addClass('jp-vgpu-indicator');
    this.node.setAttribute('role', 'button');
    this.node.title = 'vGPU memory used / budget. Click to show vGPU usage.';
    this.node.addEventListener('click', onClick);
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
    let text = 'vGPU …';
    let warn = false;
    if (usage && usage.slice) {
      text = `vGPU ${formatPair(usage.totals.used, usage.slice.memory_limit)}`;
      warn = usage.totals.used > WARN_FRACTION * usage.slice.memory_limit;
    } else if (usage) {
      text = 'vGPU: no slice';
    } else if (this.model.connection === 'error') {
      text = 'vGPU: offline';
    }
    this.node.textContent = text;
    this.node.classList.toggle('jp-mod-warn', warn);
  }
}
