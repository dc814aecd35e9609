import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

/** Root of the server extension's endpoints. */
export const API_NAMESPACE = 'api/vgpu';

/**
 * Call the server extension's REST API and parse the JSON answer.
 *
 * @param endPoint - path below `/api/vgpu`, e.g. `usage`.
 * @param init - fetch options (method, body).
 * @throws ServerConnection.NetworkError when the server cannot be reached,
 *   ServerConnection.ResponseError on a non-2xx answer.
 */
export async function requestAPI<T>(endPoint = '', init: RequestInit = {}): Promise<T> {
  const settings = ServerConnection.makeSettings();
  const url = URLExt.join(settings.baseUrl, API_NAMESPACE, endPoint);
  let response: Response;
  try {
    response = await ServerConnection.makeRequest(url, init, settings);
  } catch (error) {
    throw new ServerConnection.NetworkError(error as TypeError);
  }
  const text = await response.text();
  if (!response.ok) {
    throw new ServerConnection.ResponseError(response, text);
  }
  return (text ? JSON.parse(text) : null) as T;
}

/**
 * Read a server-sent-events endpoint below `/api/vgpu`, calling `onData` with the
 * `data` of each event, and `onAlive` (if given) on every chunk read (an event or a
 * comment line, such as the server's heartbeat), until the server ends the stream or
 * `signal` aborts it.
 *
 * The request is made with `fetch` through `ServerConnection.makeRequest`, so it
 * carries JupyterLab's own credentials (the token in the `Authorization` header, or
 * the session cookie with its `X-XSRFToken` header) and none travels in the URL, as it
 * would with `EventSource`, which cannot send headers.
 *
 * @throws ServerConnection.NetworkError when the server cannot be reached,
 *   ServerConnection.ResponseError on a non-2xx answer; an abort ends it quietly.
 */
export async function streamAPI(
  endPoint: string,
  onData: (data: string) => void,
  signal: AbortSignal,
  onAlive?: () => void
): Promise<void> {
  const settings = ServerConnection.makeSettings();
  const url = URLExt.join(settings.baseUrl, API_NAMESPACE, endPoint);
  let response: Response;
  try {
    response = await ServerConnection.makeRequest(
      url,
      { signal, headers: { Accept: 'text/event-stream' } },
      settings
    );
  } catch (error) {
    if (signal.aborted) {
      return;
    }
    throw new ServerConnection.NetworkError(error as TypeError);
  }
  if (!response.ok || !response.body) {
    throw new ServerConnection.ResponseError(response, await response.text());
  }
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = '';
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) {
        return;
      }
      onAlive?.();
      buffer += decoder.decode(value, { stream: true });
      let end: number;
      while ((end = buffer.indexOf('\n\n')) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = event
          .split('\n')
          .filter(line => line.startsWith('data:'))
          .map(line => line.slice(5).replace(/^ /, ''))
          .join('\n');
        if (data) {
          onData(data);
        }
      }
    }
  } catch (error) {
    if (!signal.aborted) {
      throw error;
    }
  }
}
