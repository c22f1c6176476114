// Wires the page: the API key field, the model list (/v1/models), the chat and the dashboard.

import { apiFetch, apiKey, clearStatus, setApiKey, showStatus } from "./api.js";
import { startChat } from "./chat.js";
import { refreshDashboard, startDashboard } from "./dashboard.js";

async function loadModels() {
  const select = document.getElementById("model");
  try {
    const { data } = await (await apiFetch("v1/models")).json();
    const chosen = select.value;
    select.replaceChildren(...data.map(({ id }) => new Option(id, id, false, id === chosen)));
    clearStatus("models");
  } catch (error) {
    if (error.status !== 401) showStatus(`models: ${error.message}`, "models");
  }
}

function startKeyForm() {
  const field = document.getElementById("api-key");
  field.value = apiKey();
  document.getElementById("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    setApiKey(field.value.trim());
    loadModels();
    refreshDashboard();
  });
}

startKeyForm();
loadModels();
startChat();
startDashboard();
