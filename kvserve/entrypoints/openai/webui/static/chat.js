// The chat: the conversation so far goes to /v1/chat/completions with stream:true, and each
// SSE delta is appended to the answer as it arrives.

import { apiFetch } from "./api.js";

const conversation = []; // {role, content} turns sent with every request
let controller = null; // aborts the request in flight (Stop)

const byId = (id) => document.getElementById(id);

function addMessage(role, text) {
  const message = document.createElement("div");
  message.className = `message ${role}`;
  const body = document.createElement("div");
  body.className = "content";
  body.textContent = text;
  const note = document.createElement("small");
  message.append(body, note);
  byId("messages").append(message);
  return { body, note };
}

function requestBody(model) {
  return {
    model,
    messages: conversation,
    stream: true,
    stream_options: { include_usage: true },
    temperature: Number(byId("temperature").value),
    top_p: Number(byId("top-p").value),
    max_tokens: Number(byId("max-tokens").value),
  };
}

// SSE events ("data: ...", blank line between) -> parsed chunks, until [DONE]
async function* sseChunks(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    const events = buffer.split(/\r?\n\r?\n/);
    buffer = events.pop();
    for (const event of events) {
      const data = event.split(/\r?\n/).filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).trim()).join("\n");
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}

// streams one answer into `answer`; returns its text and what the note under it says
async function streamAnswer(model, answer, signal) {
  const started = performance.now();
  const response = await apiFetch("v1/chat/completions", {
    method: "POST", headers: { "Content-Type": "application/json" },
    body: JSON.stringify(requestBody(model)), signal,
  });
  let firstTokenAt = null;
  let usage = null;
  for await (const chunk of sseChunks(response)) {
    if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
    const delta = chunk.choices?.[0]?.delta?.content;
    if (delta) {
      firstTokenAt ??= performance.now();
      answer.body.textContent += delta;
      byId("messages").scrollTop = byId("messages").scrollHeight;
    }
    usage = chunk.usage ?? usage;
  }
  const ttft = firstTokenAt === null ? "" : `, first token ${Math.round(firstTokenAt - started)} ms`;
  return `${usage?.completion_tokens ?? "?"} tokens${ttft}`;
}

async function send(event) {
  event.preventDefault();
  const prompt = byId("prompt").value.trim();
  if (!prompt || controller) return;
  byId("prompt").value = "";
  conversation.push({ role: "user", content: prompt });
  addMessage("user", prompt);
  const answer = addMessage("assistant", "");
  controller = new AbortController();
  byId("send").disabled = true;
  byId("stop").disabled = false;
  try {
    answer.note.textContent = await streamAnswer(byId("model").value, answer, controller.signal);
  } catch (error) {
    answer.note.textContent = error.name === "AbortError" ? "stopped" : `error: ${error.message}`;
    answer.note.className = error.name === "AbortError" ? "" : "error";
  } finally {
    if (answer.body.textContent) conversation.push({ role: "assistant", content: answer.body.textContent });
    else conversation.pop(); // unanswered: the next request does not repeat the question
    controller = null;
    byId("send").disabled = false;
    byId("stop").disabled = true;
  }
}

export function startChat() {
  byId("chat-form").addEventListener("submit", send);
  byId("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) send(event);
  });
  byId("stop").addEventListener("click", () => controller?.abort());
  byId("clear").addEventListener("click", () => {
    conversation.length = 0;
    byId("messages").replaceChildren();
  });
}
