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

/** The value of cookie `name`, or undefined. */
function getCookie(name: string): string | undefined {
  for (const part of document.cookie.split(';')) {
    const [key, ...value] = part.trim().split('=');
    if (key === name) {
      return decodeURIComponent(value.join('='));
    }
  }
  return undefined;
}

/**
 * URL of a server-sent-events endpoint below `/api/vgpu`. EventSource cannot send
 * headers, so the credentials JupyterLab sends as headers go in the query: the token
 * when the settings have one, and the `_xsrf` cookie's value, which cookie-authenticated
 * servers (such as JupyterHub's single-user servers) require of script-made requests.
 */
export function eventStreamURL(endPoint: string): string {
  const settings = ServerConnection.makeSettings();
  const url = URLExt.join(settings.baseUrl, API_NAMESPACE, endPoint);
  const query: Record<string, string> = {};
  if (settings.token) {
    query.token = settings.token;
  }
  const xsrf = getCookie('_xsrf');
  if (xsrf) {
    query._xsrf = xsrf;
  }
  return url + URLExt.objectToQueryString(query);
}
