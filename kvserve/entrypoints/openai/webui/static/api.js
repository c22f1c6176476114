// Calls to the server with the API key the user entered (kept in sessionStorage), and the
// status line that says what went wrong (a 401 above all: the page itself loads without a key).

const KEY_NAME = "kvserve-api-key";
const AUTH_MESSAGE = "401 Unauthorized: this server needs an API key. " +
  "Enter it in the \u201cAPI key\u201d field above and press \u201cUse key\u201d.";

export function apiKey() {
  return sessionStorage.getItem(KEY_NAME) || "";
}

export function setApiKey(key) {
  if (key) sessionStorage.setItem(KEY_NAME, key);
  else sessionStorage.removeItem(KEY_NAME);
}

export class HttpError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

// fetch() with the key; a non-2xx answer throws HttpError with the server's own message
export async function apiFetch(path, options = {}) {
  const headers = { ...(options.headers || {}) };
  if (apiKey()) headers.Authorization = `Bearer ${apiKey()}`;
  const response = await fetch(path, { ...options, headers });
  if (response.status === 401) {
    showStatus(AUTH_MESSAGE, "auth");
    throw new HttpError(401, AUTH_MESSAGE);
  }
  if (!response.ok) throw new HttpError(response.status, await errorText(response));
  clearStatus("auth");
  return response;
}

async function errorText(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    return `${response.status}: ${body.error?.message ?? body.detail ?? text}`;
  } catch {
    return `${response.status}: ${text || response.statusText}`;
  }
}

const statusLine = () => document.getElementById("status");

// kind: which problem the line shows, so a success clears only its own kind of message
export function showStatus(message, kind = "error") {
  statusLine().textContent = message;
  statusLine().dataset.kind = kind;
  statusLine().hidden = false;
}

export function clearStatus(kind) {
  if (statusLine().dataset.kind === kind) {
    statusLine().hidden = true;
    statusLine().textContent = "";
    delete statusLine().dataset.kind;
  }
}
