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
 * URL of a server-sent-events endpoint below `/api/vgpu`, carrying the token
 * as a query parameter when the settings have one (EventSource cannot send headers;
 * cookie-authenticated servers, such as those behind JupyterHub, need none).
 */
export function eventStreamURL(endPoint: string): string {
  const settings = ServerConnection.makeSettings();
  const url = URLExt.join(settings.baseUrl, API_NAMESPACE, endPoint);
  return settings.token ? `${url}?token=${encodeURIComponent(settings.token)}` : url;
}
