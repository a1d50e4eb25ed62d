// An agent in JavaScript with nothing but Node's global `fetch` (Node 18+, no npm package):
// it talks to "an OpenAI endpoint" read from OPENAI_BASE_URL and OPENAI_API_KEY, as Astra's
// `agent` workflow sets them, and names the policy ASTRA_MODEL with the prompt ASTRA_PROMPT.
//
// Its conversation (tests/test_agent_node.py drives the same one through the Python `openai`
// client and compares the recorded tokens): a chat turn, a second chat turn streamed with the
// first answer kept in the context, a text completion, and a streamed text completion that
// continues it. Greedy (temperature 0) with a fixed seed. Its last line is its answer.

const base = (process.env.OPENAI_BASE_URL || "").replace(/\/+$/, "");
const key = process.env.OPENAI_API_KEY;
const model = process.env.ASTRA_MODEL;
const prompt = process.env.ASTRA_PROMPT;
const settings = { temperature: 0, seed: 7 };

async function post(path, body) {
  const res = await fetch(`${base}${path}`, {
    method: "POST",
    headers: { "Content-Type": "application/json", Authorization: `Bearer ${key}` },
    body: JSON.stringify({ model, ...settings, ...body }),
  });
  if (!res.ok) throw new Error(`${path}: HTTP ${res.status}: ${await res.text()}`);
  if (!body.stream) return res.json();
  // Server-sent events: `data: {chunk}` blocks, then `data: [DONE]`.
  const text = await res.text();
  const chunks = [];
  for (const block of text.split("\n\n")) {
    const data = block.trim().replace(/^data: /, "");
    if (!data || data === "[DONE]") continue;
    const chunk = JSON.parse(data);
    if (chunk.error) throw new Error(`${path}: ${chunk.error.message}`);
    chunks.push(chunk);
  }
  return chunks;
}

const messages = [{ role: "user", content: prompt }];
const first = await post("/chat/completions", { messages, max_tokens: 4, stop: ["\n"] });
messages.push({ role: "assistant", content: first.choices[0].message.content });
messages.push({ role: "user", content: `again: ${prompt}` });
const second = await post("/chat/completions", { messages, max_tokens: 4, stream: true });
const chatAnswer = second.map((c) => c.choices[0].delta.content || "").join("");

const third = await post("/completions", { prompt, max_tokens: 6 });
const context = `${prompt}${third.choices[0].text}\n${prompt}`;
const fourth = await post("/completions", { prompt: context, max_tokens: 6, stream: true });
const textAnswer = fourth.map((c) => c.choices[0].text).join("");

console.log(JSON.stringify({ chat: chatAnswer, text: textAnswer }));
console.log(textAnswer.trim());
