import { ILabShell } from '@jupyterlab/application';
import { ISessionContext } from '@jupyterlab/apputils';
import { Widget } from '@lumino/widgets';

import { KernelState } from './contracts';
import { requestAPI } from './handler';
import { UsageModel } from './model';

/** Kernel states whose memory is off the GPU. */
const AWAY: ReadonlySet<KernelState> = new Set<KernelState>(['paused', 'suspended']);

/** What counts as the user starting to work in a notebook: focus, typing, a click. */
const ACTIVITY = ['focusin', 'keydown', 'pointerdown'] as const;

/**
 * Tells the server when the user starts working in a notebook (or console) whose kernel is
 * paused or suspended: it is opened or brought to the front, a cell gets the focus, a key is
 * pressed or the pointer goes down in it. The server passes the word to the kernel, which asks
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
    const poke = () => void this.poke(session);
    for (const type of ACTIVITY) {
      node.addEventListener(type, poke, true);
    }
    this._detach = () => {
      for (const type of ACTIVITY) {
        node.removeEventListener(type, poke, true);
      }
    };
    poke(); // opened, or brought to the front
  }

  private _asked = new Map<string, number>();
  private _detach: (() => void) | null = null;
}

/** The session of a notebook or console panel (both carry `sessionContext`), else null. */
function sessionOf(widget: Widget | null): ISessionContext | null {
  const context = (widget as { sessionContext?: ISessionContext } | null)?.sessionContext;
  return context && typeof context === 'object' && 'session' in context ? context : null;
}
