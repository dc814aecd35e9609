import { ILabShell } from '@jupyterlab/application';
import { ISessionContext } from '@jupyterlab/apputils';
import { Widget } from '@lumino/widgets';

import { KernelState } from './contracts';
import { requestAPI } from './handler';
import { UsageModel } from './model';

/** Kernel states whose memory is off the GPU. */
const AWAY: ReadonlySet<KernelState> = new Set<KernelState>(['paused', 'suspended']);

/** Where the user works in a notebook or console: its cells and its prompt. */
const CELL = '.jp-Cell, .jp-CodeConsole-promptCell';

/**
 * Whether `event` is the user starting to work in a cell: a click in it, or typing in it (a
 * key without Ctrl, Alt or Meta: those are the shell's shortcuts, such as the command palette).
 * A focus that comes back on its own (a closed dialog or palette) is not.
 */
function working(event: Event): boolean {
  const target = event.target;
  if (!(target instanceof Element) || !target.closest(CELL)) {
    return false;
  }
  if (event instanceof KeyboardEvent) {
    return !(event.ctrlKey || event.altKey || event.metaKey);
  }
  return true;
}

const ACTIVITY = ['keydown', 'pointerdown'] as const;

/**
 * Tells the server when the user starts working in a notebook (or console) whose kernel is
 * paused or suspended: it is opened or brought to the front, a cell is clicked or typed in. The server passes the word to the kernel, which asks
 * the node arbiter to bring it back before the cell runs, where the card has room
 * (`POST /api/vgpu/kernels/<id>/prefetch`).
 *
 * At most one request per kernel every `minSeconds` from this page (the server and the arbiter
 * have limits of their own), and none for a kernel the latest usage document shows on the GPU.
 */
export class Prefetcher {
  constructor(
    private readonly model: UsageModel,
    private readonly minSeconds = 5
  ) {}

  /** Follow the shell's current widget from now on. */
  watch(shell: ILabShell): void {
    shell.currentChanged.connect((_, args) => this._follow(args.newValue));
    this._follow(shell.currentWidget);
  }

  /**
   * Ask for the kernel of `session` to come back, if it is away and was not asked for lately.
   *
   * @returns whether a request was sent and accepted (202).
   */
  async poke(session: ISessionContext): Promise<boolean> {
    const id = session.session?.kernel?.id;
    if (!id) {
      return false;
    }
    const kernel = this.model.usage?.kernels.find(k => k.id === id);
    if (!kernel?.state || !AWAY.has(kernel.state)) {
      return false;
    }
    const now = Date.now() / 1000;
    if (now - (this._asked.get(id) ?? 0) < this.minSeconds) {
      return false;
    }
    this._asked.set(id, now);
    try {
      await requestAPI(`kernels/${encodeURIComponent(id)}/prefetch`, { method: 'POST' });
      return true;
    } catch {
      return false; // refused (429) or unreachable: the cell brings the kernel back as usual
    }
  }

  private _follow(widget: Widget | null): void {
    this._detach?.();
    this._detach = null;
    const session = sessionOf(widget);
    if (!widget || !session) {
      return;
    }
    const node = widget.node;
    const onActivity = (event: Event) => {
      if (working(event)) {
        void this.poke(session);
      }
    };
    for (const type of ACTIVITY) {
      node.addEventListener(type, onActivity, true);
    }
    this._detach = () => {
      for (const type of ACTIVITY) {
        node.removeEventListener(type, onActivity, true);
      }
    };
    void this.poke(session); // opened, or brought to the front
  }

  private _asked = new Map<string, number>();
  private _detach: (() => void) | null = null;
}

/** The session of a notebook or console panel (both carry `sessionContext`), else null. */
function sessionOf(widget: Widget | null): ISessionContext | null {
  const context = (widget as { sessionContext?: ISessionContext } | null)?.sessionContext;
  return context && typeof context === 'object' && 'session' in context ? context : null;
}
