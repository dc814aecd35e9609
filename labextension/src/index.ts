import {
  ILabShell,
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { ICommandPalette } from '@jupyterlab/apputils';
import { IStatusBar } from '@jupyterlab/statusbar';

import { vgpuIcon } from './icon';
import { UsageIndicator } from './indicator';
import { UsageModel } from './model';
import { Prefetcher } from './prefetch';
import { UsagePanel } from './widget';

/** Command ids. */
export namespace CommandIDs {
  export const show = 'jupyter-vgpu:show-usage';
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'jupyter-vgpu:plugin',
  description:
    'vGPU usage: a sidebar panel, a status-bar item and a command to open the panel; a paused kernel is brought back as its user starts working in its notebook.',
  autoStart: true,
  optional: [ICommandPalette, IStatusBar, ILayoutRestorer, ILabShell],
  activate: (
    app: JupyterFrontEnd,
    palette: ICommandPalette | null,
    statusBar: IStatusBar | null,
    restorer: ILayoutRestorer | null,
    labShell: ILabShell | null
  ) => {
    const model = new UsageModel();
    const panel = new UsagePanel(model);
    app.shell.add(panel, 'right', { rank: 900 });
    restorer?.add(panel, panel.id);

    app.commands.addCommand(CommandIDs.show, {
      label: 'Show vGPU usage',
      caption: 'Open the vGPU usage panel',
      icon: vgpuIcon,
      execute: () => app.shell.activateById(panel.id)
    });
    palette?.addItem({ command: CommandIDs.show, category: 'vGPU' });

    statusBar?.registerStatusItem('jupyter-vgpu:status', {
      item: new UsageIndicator(model, () => void app.commands.execute(CommandIDs.show)),
      align: 'left',
      rank: 5
    });

    model.start();
    if (labShell) {
      new Prefetcher(model).watch(labShell);
    }
  }
};

export default plugin;
