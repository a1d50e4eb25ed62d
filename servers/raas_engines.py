"""Builds the inference engine `astra serve raas` runs on: torch, vLLM, SGLang or OpenAI.

torch loads one model object per policy in-process. The HTTP engines serve
one policy each: they attach to a running server (`engine_url`) or launch
one (vLLM, SGLang) with `engine_python`, which may point at a separate
environment since those packages pin their own torch.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from astra.errors import InvalidArgument


async def build_engine(opts: Any) -> Any:
    """The engine for `RaasOptions` (see servers.raas_serve)."""
    if opts.engine == "torch":
        from astra.engine.tiny import load_model
        from astra.engine.torch_engine import TorchEngine

        models = {
            policy: await asyncio.to_thread(load_model, opts.model, opts.device)
            for policy in opts.policies
        }
        return TorchEngine(models, opts.device, max_batch=opts.capacity, on_swap=opts.on_swap)
    if len(opts.policies) != 1:
        raise InvalidArgument(
            f"--engine {opts.engine} serves one policy per RaaS, got {opts.policies}",
            reason="ONE_POLICY_PER_HTTP_ENGINE",
            field_violations=[("policy", "exactly one with an HTTP engine")],
        )
    from astra.engine.http import OpenAIEngine, SGLangEngine, VLLMEngine
    from astra.engine.tokenizer import load_tokenizer

    (policy,) = opts.policies
    tokenizer = await asyncio.to_thread(load_tokenizer, opts.model)
    log_path = Path(opts.state_dir) / f"{opts.engine}-server.log"
    Path(opts.state_dir).mkdir(parents=True, exist_ok=True)
    extra = opts.engine_args.split() if opts.engine_args else ()
    if opts.engine == "openai":
        if not opts.engine_url:
            raise InvalidArgument(
                "--engine openai needs --engine-url",
                reason="INVALID_FIELD",
                field_violations=[("engine_url", "required for openai")],
            )
        engine = OpenAIEngine(
            opts.engine_url,
            opts.served_model_name,
            policy,
            tokenizer,
            hot_loaded=opts.hot_loaded,
            logprobs_mode=opts.engine_logprobs_mode,
        )
    elif opts.engine == "vllm":
        if not opts.engine_url:
            if not opts.engine_python:  # `astra serve raas` has resolved and checked it
                from astra.engine.http.vllm_env import vllm_python

                opts.engine_python = await asyncio.to_thread(vllm_python)
            model = await asyncio.to_thread(served_model_dir, opts.model, opts.state_dir)
        engine = (
            VLLMEngine(
                opts.engine_url,
                opts.served_model_name,
                policy,
                tokenizer,
                on_swap=opts.on_swap,
                logprobs_mode=opts.engine_logprobs_mode,
            )
            if opts.engine_url
            else VLLMEngine.launch(
                model,
                policy,
                tokenizer,
                extra_args=extra,
                served_model_name=opts.served_model_name,
                log_path=log_path,
                python=opts.engine_python,
                on_swap=opts.on_swap,
            )
        )
    elif opts.engine == "sglang":
        engine = (
            SGLangEngine(opts.engine_url, policy, tokenizer, on_swap=opts.on_swap)
            if opts.engine_url
            else SGLangEngine.launch(
                served_model_dir(opts.model, opts.state_dir),
                policy,
                tokenizer,
                extra_args=extra,
                log_path=log_path,
                python=opts.engine_python,
                on_swap=opts.on_swap,
            )
        )
    else:
        raise InvalidArgument(f"unknown engine {opts.engine!r}", reason="INVALID_FIELD")
    await engine.wait_ready()
    return engine


def served_model_dir(model: str, state_dir: str) -> str:
    """The directory a launched server loads: `model`, or for `tiny` its export (config,
    safetensors and tokenizer files) written once under `state_dir`."""
    from astra.engine.tiny import TINY, save_tiny

    if model != TINY:
        return model
    target = Path(state_dir) / "model-tiny"
    if not target.is_dir():
        save_tiny(target)
    return str(target)
