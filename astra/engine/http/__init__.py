"""Inference engines behind HTTP servers: vLLM, SGLang and any OpenAI-compatible endpoint.

Each adapter implements astra.engine.api.InferenceEngine for one policy on one
server, which it can launch or attach to. Weight swaps take a `WeightsDir`
(a verified local checkpoint directory) and run pause -> update from disk ->
resume, or live where vLLM can; see astra.engine.http.swap. No GPU package is
imported here: the servers run in their own processes.
"""

from astra.engine.http.base import HTTPEngine
from astra.engine.http.openai import OpenAIEngine
from astra.engine.http.sglang import SGLangEngine
from astra.engine.http.vllm import VLLMEngine
from astra.engine.http.weights_dir import WeightsDir

__all__ = ["HTTPEngine", "OpenAIEngine", "SGLangEngine", "VLLMEngine", "WeightsDir"]
