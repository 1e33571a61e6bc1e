// What both pages share: API calls that carry the token and turn error answers into their server's message, the
// token form a 401 opens, the error line, and a small element builder (text only, so labels from a model can
// never inject markup).

const TOKEN_KEY = "petal.token";

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

// Kept in this tab's session storage only: it is gone when the tab closes and no other tab or site sees it.
export function token() {
  return sessionStorage.getItem(TOKEN_KEY) || "";
}

export const enc = encodeURIComponent;

// fetch, with the bearer token when there is one; resolves to {body, ms} on 2xx and throws ApiError otherwise.
// `ms` is the whole round trip as the page saw it, until the last byte of the answer.
export async function call(path, init = {}) {
  const headers = new Headers(init.headers);
  if (token()) headers.set("Authorization", `Bearer ${token()}`);
  const started = performance.now();
  let response, text;
  try {
    response = await fetch(path, { ...init, headers });
    text = await response.text();
  } catch (error) {
    throw new ApiError(0, `Could not reach the server: ${error.message}`);
  }
  const ms = performance.now() - started;
  let body = null;
  try {
    body = JSON.parse(text);
  } catch {
    // not JSON: the status line below says what went wrong
  }
  if (!response.ok) {
    const message = typeof body?.error === "string" ? body.error : `${response.status} ${response.statusText}`;
    throw new ApiError(response.status, message);
  }
  return { body, ms };
}

export function showError(message) {
  const error = document.getElementById("error");
  error.textContent = message;
  error.hidden = false;
}

function hideError() {
  const error = document.getElementById("error");
  error.hidden = true;
  error.textContent = "";
}

// The server wants a token: show the form with its message, and run `retry` once one is entered.
function askForToken(message, retry) {
  const form = document.getElementById("token-form");
  const input = form.querySelector("input");
  form.querySelector(".why").textContent = message;
  form.hidden = false;
  input.focus();
  form.onsubmit = (event) => {
    event.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, input.value.trim());
    input.value = "";
    form.hidden = true;
    retry();
  };
}

// Run an action of the page; a 401 asks for a token and runs it again, any other failure shows its message.
export async function guarded(action) {
  try {
    hideError();
    await action();
  } catch (error) {
    if (error.status === 401) askForToken(error.message, () => guarded(action));
    else showError(error.message);
  }
}

// el("td", {class: "x"}, "text", child): attributes and children, text always as text.
export function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
  node.append(...children.filter((child) => child !== null && child !== undefined));
  return node;
}
