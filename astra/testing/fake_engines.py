"""FAKE engine servers: real local HTTP servers that speak the documented subset of the vLLM,
SGLang and OpenAI APIs, backed by the built-in torch model, for testing the HTTP adapters.

These are FAKES, not vLLM or SGLang: same routes, request fields and answer
shapes as astra.engine.http relies on (see its module docstrings), nothing
more. Every answer carries the header `X-Fake-Engine: <flavor>` and the
default served model name is "FAKE-tiny". Log-probs are real: each token comes
from a full forward pass (no cache) of an astra CausalLM (`tiny` or a local
HF directory), so they can be checked against the built-in engine.

Flavors and routes:
- "openai": GET /health, GET /v1/models, POST /v1/completions.
- "vllm": the above plus POST /pause (query mode=abort|wait|keep, the deprecated
  clear_cache), POST /resume, GET /is_paused, POST /collective_rpc
  {method: "reload_weights" or "astra_reload_weights", kwargs: {weights_path}}; as real
  vLLM 0.32, a reload that fails leaves the engine dead (every later completion: 500).
- "sglang": GET /health, GET /v1/models, GET /get_model_info,
  GET /get_weight_version, POST /generate, POST /pause_generation {mode},
  POST /continue_generation, POST /flush_cache, POST /update_weights_from_disk
  {model_path, weight_version, flush_cache}, POST /abort_request {rid, abort_all}.

Log-prob conventions follow the real servers: vllm/openai report
log_softmax(logits) (vLLM's default raw_logprobs, before temperature), or with
`logprobs_mode="processed_logprobs"` (vLLM's `--logprobs-mode`) the log-prob
of the distribution sampled from: after temperature, top-k and top-p;
sglang reports log_softmax(logits / temperature) (temperature 0 counted as
1) before top-k/top-p. Pausing with mode "abort" ends running requests at their next
step with finish reason abort and the tokens so far; requests that arrive
while paused wait for resume. Every call is recorded (`calls`, `paths()`), and
`fail(path, status)` makes the next call(s) to a path fail, for error tests.
`token_ids_field=True` stands for an OpenAI-compatible server that always
returns `choices[0].token_ids` (as vLLM does with `return_token_ids`).

    with FakeEngineServer("sglang", step_delay_s=0.01) as fake:
        engine = SGLangEngine(fake.url, "p", CharTokenizer())
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from typing import Any, Literal
from urllib.parse import parse_qs, urlsplit

import torch

from astra.engine.tiny import load_model
from astra.engine.torch_weights import load_state
from astra.testing.fake_engine_http import make_handler

Flavor = Literal["openai", "vllm", "sglang"]
Route = Callable[[dict[str, str], Any], Any]  # (query, JSON body) -> answer


class FakeHTTPError(Exception):
    """An error answer: `body` as given, or an OpenAI-style {"error": {...}} around `message`."""

    def __init__(self, status: int, message: str, body: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.body = body


class _Aborted(Exception):
    pass


@dataclass(frozen=True, slots=True)
class FakeCall:
    """One request the FAKE server received."""

    method: str
    path: str
    query: dict[str, str]
    body: Any
    t: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class _Params:
    max_new: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop_strings: tuple[str, ...]
    stop_ids: frozenset[int]


class FakeEngineServer:
    """A FAKE engine server of one flavor on 127.0.0.1 (port 0 = any free port)."""

    def __init__(
        self,
        flavor: Flavor,
        model: str | os.PathLike[str] = "tiny",
        *,
        served_model_name: str = "FAKE-tiny",
        step_delay_s: float = 0.0,
        max_model_len: int | None = None,
        token_ids_field: bool = False,
        logprobs_mode: str = "raw_logprobs",
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        if flavor not in ("openai", "vllm", "sglang"):
            raise ValueError(f"unknown FAKE flavor {flavor!r}")
        if logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            raise ValueError(f"unknown logprobs_mode {logprobs_mode!r}")
        self.flavor: Flavor = flavor
        self.logprobs_mode = logprobs_mode
        self.model, self.tokenizer = load_model(model)
        self.served_model_name = served_model_name
        self.engine_dead: str | None = None  # vllm: set by a reload that failed
        self.step_delay_s = step_delay_s
        self.token_ids_field = token_ids_field  # always put choices[0].token_ids in completions
        self.max_model_len = max_model_len or self.model.cfg.max_position_embeddings
        self.eos_ids = frozenset({self.tokenizer.eos_id, *self.model.cfg.eos_token_ids})
        self.weight_version: str | None = "0" if flavor == "sglang" else None
        self.loaded_paths: list[str] = []
        self.calls: list[FakeCall] = []
        self._failures: dict[str, list[tuple[int, str]]] = {}
        self._model_lock = threading.Lock()
        self._cond = threading.Condition()
        self._paused = False
        self._running: set[str] = set()
        self._aborted: set[str] = set()
        self._routes = self._route_table()
        handler = make_handler(self)
        self._httpd = ThreadingHTTPServer((host, port), handler)
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host if isinstance(host, str) else host.decode()}:{port}"

    def start(self) -> FakeEngineServer:
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"fake-{self.flavor}",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._aborted |= self._running
            self._paused = False
            self._cond.notify_all()
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(10)

    def __enter__(self) -> FakeEngineServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- test controls -------------------------------------------------------------------

    def paths(self, method: str | None = None) -> list[str]:
        """Paths called so far, in order (optionally only one method's)."""
        return [c.path for c in self.calls if method is None or c.method == method]

    def fail(
        self, path: str, status: int = 500, message: str = "FAKE failure", times: int = 1
    ) -> None:
        """The next `times` calls to `path` answer `status` with `message`."""
        self._failures.setdefault(path, []).extend([(status, message)] * times)

    @property
    def running(self) -> int:
        with self._cond:
            return len(self._running)

    def load_dir(self, path: str | os.PathLike[str]) -> None:
        """Loads every tensor of a local HF directory into the model (FakeHTTPError 400 if bad)."""
        try:
            state = load_state(path)
            with self._model_lock:
                self.model.load_weights(state)
        except Exception as exc:
            raise FakeHTTPError(400, f"failed to load weights from {path}: {exc}") from exc
        self.loaded_paths.append(str(path))

    # -- model ---------------------------------------------------------------------------

    def _sample(self, ids: list[int], p: _Params, gen: torch.Generator | None) -> tuple[int, float]:
        with self._model_lock, torch.no_grad():
            logits = self.model.forward_full(torch.tensor([ids]))[0, -1].float()
        temp = p.temperature if p.temperature > 0 else 1.0
        if self.flavor == "sglang":
            report = torch.log_softmax(logits / temp, -1)
        else:
            report = torch.log_softmax(logits, -1)
        if p.temperature == 0:
            token = int(torch.argmax(logits))
        else:
            probs = torch.softmax(logits / temp, -1)
            if 0 < p.top_k < probs.numel():
                kth = torch.topk(probs, p.top_k).values[-1]
                probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
            if p.top_p < 1.0:
                sorted_p, order = torch.sort(probs, descending=True)
                before = torch.cumsum(sorted_p, 0) - sorted_p
                sorted_p = torch.where(before < p.top_p * sorted_p.sum(), sorted_p, 0.0)
                probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
            token = int(torch.multinomial(probs / probs.sum(), 1, generator=gen))
            if self.logprobs_mode == "processed_logprobs" and self.flavor != "sglang":
                report = torch.log(probs / probs.sum())  # what was sampled from
        return token, float(report[token])

    def _generate(
        self, prompt: list[int], p: _Params, rid: str
    ) -> tuple[list[int], list[float], str, str | int | None]:
        """(tokens, log-probs, finish: stop|length|abort, matched stop)."""
        if any(not 0 <= t < self.model.cfg.vocab_size for t in prompt):
            raise FakeHTTPError(400, "token id out of vocabulary")
        if len(prompt) + p.max_new > self.max_model_len:
            raise FakeHTTPError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {len(prompt) + p.max_new} tokens.",
            )
        gen = None
        if p.temperature > 0:
            seed = p.seed if p.seed is not None else int(torch.randint(0, 2**62, ()))
            gen = torch.Generator().manual_seed(seed)
        with self._cond:
            self._cond.wait_for(lambda: not self._paused)
            self._running.add(rid)
        tokens: list[int] = []
        lps: list[float] = []
        try:
            for _ in range(p.max_new):
                with self._cond:
                    self._cond.wait_for(lambda: not self._paused or rid in self._aborted)
                    if rid in self._aborted:
                        return tokens, lps, "abort", None
                token, lp = self._sample(prompt + tokens, p, gen)
                tokens.append(token)
                lps.append(lp)
                if token in self.eos_ids or token in p.stop_ids:
                    return tokens, lps, "stop", token
                if p.stop_strings:
                    text = self.tokenizer.decode(tokens)
                    hits = [(text.find(s), s) for s in p.stop_strings if s in text]
                    if hits:
                        return tokens, lps, "stop", min(hits)[1]
                if self.step_delay_s:
                    time.sleep(self.step_delay_s)
            return tokens, lps, "length", None
        finally:
            with self._cond:
                self._running.discard(rid)
                self._aborted.discard(rid)
                self._cond.notify_all()

    def _pause(self, mode: str) -> dict[str, str]:
        with self._cond:
            if mode == "wait":
                self._cond.wait_for(lambda: not self._running, timeout=60)
            self._paused = True
            if mode == "abort":
                self._aborted |= self._running
            self._cond.notify_all()
        return {"message": "Generation paused successfully.", "status": "ok"}

    def _resume(self) -> dict[str, str]:
        with self._cond:
            self._paused = False
            self._cond.notify_all()
        return {"message": "Generation continued successfully.", "status": "ok"}

    # -- routes --------------------------------------------------------------------------

    def _route_table(self) -> dict[tuple[str, str], Route]:
        routes: dict[tuple[str, str], Route] = {
            ("GET", "/health"): lambda q, b: "",
            ("GET", "/v1/models"): self._models,
        }
        if self.flavor in ("openai", "vllm"):
            routes[("POST", "/v1/completions")] = self._completions
        if self.flavor == "vllm":
            routes[("POST", "/pause")] = lambda q, b: self._pause(q.get("mode", "abort"))
            routes[("POST", "/resume")] = lambda q, b: self._resume()
            routes[("GET", "/is_paused")] = lambda q, b: {"is_paused": self._paused}
            routes[("POST", "/collective_rpc")] = self._collective_rpc
        if self.flavor == "sglang":
            routes[("POST", "/generate")] = self._sglang_generate
            routes[("GET", "/get_model_info")] = lambda q, b: {
                "model_path": "FAKE",
                "is_generation": True,
                "weight_version": self.weight_version,
            }
            routes[("GET", "/get_weight_version")] = lambda q, b: {
                "weight_version": self.weight_version
            }
            routes[("POST", "/pause_generation")] = lambda q, b: self._pause(
                (b or {}).get("mode", "abort")
            )
            routes[("POST", "/continue_generation")] = lambda q, b: self._resume()
            routes[("POST", "/flush_cache")] = self._flush_cache
            routes[("GET", "/flush_cache")] = self._flush_cache
            routes[("POST", "/update_weights_from_disk")] = self._update_from_disk
            routes[("POST", "/abort_request")] = self._abort_request
        return routes

    def handle(self, method: str, raw_path: str, body: Any) -> tuple[int, Any]:
        parts = urlsplit(raw_path)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        self.calls.append(FakeCall(method, parts.path, query, body))
        queued = self._failures.get(parts.path)
        if queued:
            status, message = queued.pop(0)
            return status, {"error": {"message": message, "type": "FakeError", "code": status}}
        route = self._routes.get((method, parts.path))
        if route is None:
            return 404, {"detail": "Not Found"}
        try:
            return 200, route(query, body)
        except FakeHTTPError as exc:
            if exc.body is not None:
                return exc.status, exc.body
            err = {"message": exc.message, "type": "BadRequestError", "code": exc.status}
            return exc.status, {"error": err}

    def _models(self, q: dict[str, str], b: Any) -> Any:
        card = {
            "id": self.served_model_name,
            "object": "model",
            "max_model_len": self.max_model_len,
        }
        return {"object": "list", "data": [card]}

    def _completions(self, q: dict[str, str], b: Any) -> Any:
        if self.engine_dead is not None:
            raise FakeHTTPError(500, "EngineCore encountered an issue (FAKE: a failed reload)")
        if not isinstance(b, dict):
            raise FakeHTTPError(400, "body must be a JSON object")
        if b.get("model") != self.served_model_name:
            raise FakeHTTPError(404, f"The model `{b.get('model')}` does not exist.")
        prompt = b.get("prompt")
        if isinstance(prompt, str):
            prompt = self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            prompt = prompt[0]
        if not isinstance(prompt, list) or not prompt:
            raise FakeHTTPError(400, "prompt must be a non-empty list of token ids")
        stop = b.get("stop") or ()
        params = _Params(
            max_new=int(b.get("max_tokens") or 16),
            temperature=_temperature(b.get("temperature", 1.0)),
            top_p=float(b.get("top_p", 1.0)),
            top_k=int(b.get("top_k") or 0),
            seed=b.get("seed"),
            stop_strings=(stop,) if isinstance(stop, str) else tuple(stop),
            stop_ids=frozenset(b.get("stop_token_ids") or ()),
        )
        ids, lps, finish, matched = self._generate([int(t) for t in prompt], params, _rid())
        if b.get("return_tokens_as_token_ids"):
            tokens = [f"token_id:{t}" for t in ids]
        else:
            tokens = [self.tokenizer.decode([t]) for t in ids]
        stop_ids = set(b.get("stop_token_ids") or ())
        stop_reason = matched if isinstance(matched, str) or matched in stop_ids else None
        choice: dict[str, Any] = {
            "index": 0,
            "text": self.tokenizer.decode(ids),
            "logprobs": {
                "tokens": tokens,
                "token_logprobs": lps,
                "top_logprobs": [{tok: lp} for tok, lp in zip(tokens, lps, strict=True)],
                "text_offset": list(range(len(ids))),
            },
            "finish_reason": finish,
            "stop_reason": stop_reason,
        }
        if b.get("return_token_ids") or self.token_ids_field:
            choice["token_ids"] = ids
        return {
            "id": f"cmpl-FAKE-{uuid.uuid4().hex[:8]}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.served_model_name,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(ids),
                "total_tokens": len(prompt) + len(ids),
            },
        }

    def _collective_rpc(self, q: dict[str, str], b: Any) -> Any:
        methods = ("reload_weights", "astra_reload_weights")  # the latter: Astra's extension
        if not isinstance(b, dict) or b.get("method") not in methods:
            raise FakeHTTPError(500, f"FAKE vLLM worker has no method {b!r}")
        path = (b.get("kwargs") or {}).get("weights_path")
        if not path:
            raise FakeHTTPError(500, "reload_weights needs weights_path in this FAKE")
        try:
            self.load_dir(path)
        except FakeHTTPError as exc:
            # As vLLM 0.32: a reload that fails in the worker kills the engine core.
            self.engine_dead = exc.message
            raise FakeHTTPError(500, f"Worker failed with error '{exc.message}'") from exc
        return {"results": [None]}

    def _sglang_generate(self, q: dict[str, str], b: Any) -> Any:
        if not isinstance(b, dict) or not isinstance(b.get("input_ids"), list):
            raise FakeHTTPError(400, "input_ids (a list of token ids) is required")
        sp = b.get("sampling_params") or {}
        stop = sp.get("stop") or ()
        params = _Params(
            max_new=int(sp.get("max_new_tokens", 128)),
            temperature=_temperature(sp.get("temperature", 1.0)),
            top_p=float(sp.get("top_p", 1.0)),
            top_k=max(0, int(sp.get("top_k", -1))),
            seed=sp.get("sampling_seed"),
            stop_strings=(stop,) if isinstance(stop, str) else tuple(stop),
            stop_ids=frozenset(sp.get("stop_token_ids") or ()),
        )
        rid = str(b.get("rid") or _rid())
        prompt = [int(t) for t in b["input_ids"]]
        ids, lps, finish, matched = self._generate(prompt, params, rid)
        if finish == "stop":
            reason: dict[str, Any] = {"type": "stop", "matched": matched}
        elif finish == "length":
            reason = {"type": "length", "length": len(ids)}
        else:
            reason = {"type": "abort", "message": "Abort by FAKE pause_generation"}
        info: dict[str, Any] = {
            "id": rid,
            "finish_reason": reason,
            "prompt_tokens": len(prompt),
            "completion_tokens": len(ids),
            "weight_version": self.weight_version,
        }
        if b.get("return_logprob"):
            info["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, ids, strict=True)]
        return {"text": self.tokenizer.decode(ids), "output_ids": ids, "meta_info": info}

    def _flush_cache(self, q: dict[str, str], b: Any) -> Any:
        with self._cond:
            if self._running and not self._paused:
                raise FakeHTTPError(400, "Cache not flushed: requests are running")
        return "Cache flushed.\n"

    def _update_from_disk(self, q: dict[str, str], b: Any) -> Any:
        if not isinstance(b, dict) or not b.get("model_path"):
            raise FakeHTTPError(400, "model_path is required")
        try:
            self.load_dir(b["model_path"])
        except FakeHTTPError as exc:
            answer = {"success": False, "message": exc.message, "num_paused_requests": 0}
            raise FakeHTTPError(400, exc.message, answer) from exc
        if b.get("weight_version") is not None:
            self.weight_version = str(b["weight_version"])
        return {"success": True, "message": "Succeeded to update model weights.",
                "num_paused_requests": 0}  # fmt: skip

    def _abort_request(self, q: dict[str, str], b: Any) -> Any:
        b = b or {}
        with self._cond:
            if b.get("abort_all"):
                self._aborted |= self._running
            elif b.get("rid") in self._running:
                self._aborted.add(str(b["rid"]))
            self._cond.notify_all()
        return ""


def _rid() -> str:
    return uuid.uuid4().hex


def _temperature(value: Any) -> float:
    t = float(value if value is not None else 1.0)
    if t < 0:
        raise FakeHTTPError(400, "temperature must be non-negative")
    return t
