"""How `VLLMEngine.launch` starts vLLM's OpenAI-compatible server: its arguments and environment.

`start_vllm` runs `python -m vllm.entrypoints.openai.api_server` on a model
directory (through astra.engine.http.launch) with the arguments Astra needs
unless the caller's decide them (`launch_defaults`: the model's dtype, chunked
prefill off, Astra's worker extension from astra/engine/http/vllm_ext), the
log-probs mode (`--logprobs-mode processed_logprobs` unless one is named; a
mode without log-probs is InvalidArgument naming engine_args), and the
environment (`launch_env`: dev mode for the pause / reload / resume endpoints,
runtime LoRA loading with `--enable-lora`, the extension on PYTHONPATH, a CPU
KV cache). Also what the engine reads back from those arguments
(`option_value`, `logprobs_mode_of`, `reload_method`). Builds command lines;
never sends a request.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from astra.engine.http.launch import ServerProcess, start_server
from astra.engine.http.openai import LOGPROBS_MODES
from astra.engine.http.vllm_lora import RUNTIME_ENV, lora_enabled
from astra.errors import InvalidArgument

DEV_MODE_ENV = {"VLLM_SERVER_DEV_MODE": "1"}
CPU_KV_CACHE_GIB = 1
EXTENSION_DIR = Path(__file__).parent / "vllm_ext"
EXTENSION_CLS = "astra_vllm_ext.AstraWorkerExtension"
EXTENSION_RELOAD = "astra_reload_weights"


def start_vllm(
    model_path: str | os.PathLike[str],
    *,
    served_model_name: str = "policy",
    host: str = "127.0.0.1",
    port: int | None = None,
    extra_args: Sequence[str] = (),
    log_path: str | os.PathLike[str] = "vllm-server.log",
    python: str = sys.executable,
) -> tuple[ServerProcess, str]:
    """Starts vLLM's OpenAI-compatible server on `model_path` in dev mode, with
    `launch_defaults` and `launch_env`, and `--logprobs-mode processed_logprobs` unless
    `extra_args` name a mode; returns (the process, the log-probs mode it reports)."""
    args = ["--model", str(model_path), "--served-model-name", served_model_name]
    args += launch_defaults(model_path, extra_args)
    mode = logprobs_mode_of(extra_args)
    if mode is None:
        mode = "processed_logprobs"
        args += ["--logprobs-mode", mode]
    elif mode not in LOGPROBS_MODES:
        raise InvalidArgument(
            f"--logprobs-mode {mode}: astra needs log-probs ({', '.join(LOGPROBS_MODES)})",
            reason="INVALID_FIELD",
            field_violations=[("engine_args", f"--logprobs-mode {mode}")],
        )
    proc = start_server(
        python,
        "vllm.entrypoints.openai.api_server",
        args,
        host=host,
        port=port,
        extra_args=extra_args,
        log_path=log_path,
        env=launch_env(extra_args),
    )
    return proc, mode


def option_value(args: Sequence[str], name: str) -> str | None:
    """The value of `--name` (as `--name V` or `--name=V`) in server arguments, or None."""
    for i, arg in enumerate(args):
        if arg.startswith(f"{name}="):
            return arg.split("=", 1)[1]
        if arg == name and i + 1 < len(args):
            return args[i + 1]
    return None


def logprobs_mode_of(args: Sequence[str]) -> str | None:
    """The `--logprobs-mode` value in vLLM server arguments, or None."""
    return option_value(args, "--logprobs-mode")


def _names(args: Sequence[str]) -> set[str]:
    return {a.split("=", 1)[0] for a in args if a.startswith("--")}


def launch_defaults(model_path: str | os.PathLike[str], extra_args: Sequence[str]) -> list[str]:
    """Arguments `launch` adds unless `extra_args` decide them:
    - `--dtype` from the model's config.json (vLLM on CPU otherwise runs an fp32 model in
      bfloat16, and its log-probs no longer match the trainer's);
    - `--no-enable-chunked-prefill`: vLLM 0.32 on CPU kills its engine on a seeded request
      whose prompt chunked prefill splits ("CPU Generator does not use offset"), and Astra
      seeds every sample."""
    given = _names(extra_args)
    out: list[str] = []
    if "--dtype" not in given:
        config = Path(model_path) / "config.json"
        with contextlib.suppress(OSError, ValueError, AttributeError):
            raw = json.loads(config.read_text())
            dtype = raw.get("dtype") or raw.get("torch_dtype")
            if isinstance(dtype, str) and dtype in ("float32", "float16", "bfloat16"):
                out += ["--dtype", dtype]
    if not given & {"--enable-chunked-prefill", "--no-enable-chunked-prefill"}:
        out.append("--no-enable-chunked-prefill")
    if reload_method(extra_args) == EXTENSION_RELOAD:
        out += ["--worker-extension-cls", EXTENSION_CLS]
    return out


def reload_method(extra_args: Sequence[str]) -> str:
    """The worker method a launched server reloads weights with: Astra's extension's,
    unless `extra_args` load another extension (then vLLM's own `reload_weights`)."""
    if "--worker-extension-cls" in _names(extra_args):
        return "reload_weights"
    return EXTENSION_RELOAD


def launch_env(extra_args: Sequence[str]) -> dict[str, str]:
    """Dev mode (the pause / reload / resume endpoints), runtime LoRA loading with
    `--enable-lora`, and, on CPU, an explicit KV cache:
    `VLLM_CPU_KVCACHE_SPACE` GiB (default 1 unless set or `--kv-cache-memory-bytes` is given;
    vLLM would otherwise take a share of the machine's RAM). GPU builds ignore it."""
    env = dict(DEV_MODE_ENV)
    if lora_enabled(extra_args):  # the runtime /v1/load_lora_adapter endpoint
        env.update(RUNTIME_ENV)
    # The worker extension (astra_vllm_ext) is importable by vLLM's processes.
    paths = [str(EXTENSION_DIR), *filter(None, [os.environ.get("PYTHONPATH", "")])]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if "--kv-cache-memory-bytes" not in _names(extra_args):
        env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get(
            "VLLM_CPU_KVCACHE_SPACE", str(CPU_KV_CACHE_GIB)
        )
    return env
