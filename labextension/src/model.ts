import { ISignal, Signal } from '@lumino/signaling';

import { CONTRACT_VERSIONS, IUsage } from './contracts';
import { requestAPI, streamAPI } from './handler';

/** One point of the usage history, in bytes; `time` in Unix seconds. */
export interface ISample {
  time: number;
  used: number;
  reserved: number;
  offloaded: number;
  budget: number | null;
}

/** How the model is receiving samples. */
export type Connection = 'connecting' | 'stream' | 'polling' | 'error';

/**
 * The latest usage document and the history of the last `historySeconds`.
 *
 * Samples arrive on the server-sent-events stream `/api/vgpu/usage/stream` (read with
 * `fetch`, credentials in headers); when the stream fails the model polls
 * `/api/vgpu/usage` every `pollSeconds` instead. A document of another layout version
 * than this panel reads (`CONTRACT_VERSIONS.usage`) is refused with an error.
 *
 * A stream or a poll that stays silent is taken for failed too (a server whose event loop
 * stopped, a proxy that holds the connection open): the stream once nothing came for
 * `silentSeconds` (the server writes at least every 4 s: a document, or a heartbeat
 * comment between samples); a poll once it has waited `silentSeconds` (the connection
 * is then `error`).
 * So the panel never shows an old document as live. A stream dropped for its silence is
 * opened again once a poll is answered; one that failed otherwise (an older server without
 * it, a browser without `ReadableStream`) leaves the model polling.
 */
export class UsageModel {
  constructor(options: UsageModel.IOptions = {}) {
    this.historySeconds = options.historySeconds ?? 300;
    this.pollSeconds = options.pollSeconds ?? 2;
    this.silentSeconds = options.silentSeconds ?? 10;
  }

  /** Seconds of history kept for the chart. */
  readonly historySeconds: number;
  /** Seconds between two polls when the stream is not available. */
  readonly pollSeconds: number;
  /** Seconds of silence after which a stream or a poll is taken for failed. */
  readonly silentSeconds: number;

  get usage(): IUsage | null {
    return this._usage;
  }

  get history(): readonly ISample[] {
    return this._history;
  }

  get connection(): Connection {
    return this._connection;
  }

  /** The last error text, or null after a successful sample. */
  get error(): string | null {
    return this._error;
  }

  /** Emitted after every sample or connection change. */
  get changed(): ISignal<this, void> {
    return this._changed;
  }

  /** Fraction of the budget in use (0..), or null without a slice. */
  get fraction(): number | null {
    const limit = this._usage?.slice?.memory_limit;
    return limit ? this._usage!.totals.used / limit : null;
  }

  /** Start receiving samples (idempotent). */
  start(): void {
    if (this._started) {
      return;
    }
    this._started = true;
    this._openStream();
  }

  /** Stop the stream and the polling. */
  dispose(): void {
    this._started = false;
    this._stream?.abort();
    this._stream = null;
    this._stopWatchdog();
    if (this._timer !== null) {
      window.clearTimeout(this._timer);
      this._timer = null;
    }
  }

  /**
   * Add one usage document (from the stream or a poll).
   *
   * @throws Error when the document has another layout version than this panel reads.
   */
  push(usage: IUsage): void {
    if (usage.version !== CONTRACT_VERSIONS.usage) {
      throw new Error(
        `the server sends usage documents of version ${usage.version}; this panel reads version ${CONTRACT_VERSIONS.usage}`
      );
    }
    this._usage = usage;
    this._error = null;
    this._history.push({
      time: usage.timestamp,
      used: usage.totals.used,
      reserved: usage.totals.reserved,
      offloaded: usage.totals.offloaded,
      budget: usage.slice ? usage.slice.memory_limit : null
    });
    const oldest = usage.timestamp - this.historySeconds;
    while (this._history.length && this._history[0].time < oldest) {
      this._history.shift();
    }
    this._changed.emit();
  }

  private _openStream(): void {
    if (typeof ReadableStream === 'undefined' || typeof AbortController === 'undefined') {
      this._startPolling();
      return;
    }
    const stream = new AbortController();
    this._stream = stream;
    this._setConnection('connecting');
    let last = Date.now();
    this._watchdog = window.setInterval(() => {
      const silent = (Date.now() - last) / 1000;
      if (silent > this.silentSeconds) {
        this._error = `no usage sample for ${Math.round(silent)} s`;
        this._silenced = true;
        stream.abort(); // the stream ends quietly; the model polls
      }
    }, 1000);
    const onData = (data: string) => {
      this._setConnection('stream');
      try {
        this.push(JSON.parse(data) as IUsage);
      } catch (error) {
        this._error = `Bad usage sample: ${error}`;
        this._changed.emit();
      }
    };
    streamAPI('usage/stream', onData, stream.signal, () => {
      last = Date.now();
    })
      .catch(error => {
        this._error = `${error}`;
      })
      .finally(() => {
        if (this._stream === stream) {
          this._stream = null;
          this._stopWatchdog();
          this._startPolling();
        }
      });
  }

  private _startPolling(): void {
    if (!this._started || this._timer !== null) {
      return;
    }
    this._setConnection('polling');
    const poll = async () => {
      this._timer = null;
      if (!this._started) {
        return;
      }
      try {
        const signal = AbortSignal.timeout(this.silentSeconds * 1000);
        this.push(await requestAPI<IUsage>('usage', { signal }));
        if (this._silenced) {
          this._silenced = false;
          this._openStream(); // the server answers again: back to its stream
          return;
        }
        this._setConnection('polling');
      } catch (error) {
        this._error = `${error}`;
        this._setConnection('error');
      }
      if (this._started) {
        this._timer = window.setTimeout(poll, this.pollSeconds * 1000);
      }
    };
    void poll();
  }

  private _stopWatchdog(): void {
    if (this._watchdog !== null) {
      window.clearInterval(this._watchdog);
      this._watchdog = null;
    }
  }

  private _setConnection(connection: Connection): void {
    if (connection !== this._connection) {
      this._connection = connection;
      this._changed.emit();
    }
  }

  private _usage: IUsage | null = null;
  private _history: ISample[] = [];
  private _connection: Connection = 'connecting';
  private _error: string | null = null;
  private _started = false;
  private _stream: AbortController | null = null;
  private _timer: number | null = null;
  private _watchdog: number | null = null;
  /** The stream was dropped for its silence alone: it is opened again once a poll is answered. */
  private _silenced = false;
  private _changed = new Signal<this, void>(this);
}

export namespace UsageModel {
  export interface IOptions {
    /** Seconds of history kept for the chart (default 300). */
    historySeconds?: number;
    /** Seconds between polls when the stream fails (default 2). */
    pollSeconds?: number;
    /**
     * Seconds of silence after which the stream, or a poll, is taken for failed (default
     * 10: two of the stream's heartbeats, which come at least every 4 s).
     */
    silentSeconds?: number;
  }
}
