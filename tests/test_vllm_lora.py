"""The vLLM engine's adapter slot without a server (astra.engine.http.vllm_lora): what it
writes for vLLM's LoRA API, what it refuses before writing anything, and the launch flags.
tests/test_vllm_lora_real.py serves what it writes on a real vLLM."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from astra.engine.http.vllm_lora import AdapterSlot, server_args
from astra.engine.tiny import TINY_CONFIG, random_model, save_tiny, tiny_model
from astra.errors import InvalidArgument
from astra.lora.format import AdapterConfig, AdapterError, base_digest, from_peft
from astra.lora.serving import AdapterVersion
from tests.test_lora_serving import adapter

BASE = {k: v.clone() for k, v in tiny_model().hf_state_dict().items()}


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("m") / "base")


def test_prepare_writes_a_peft_directory_per_version_and_commit_keeps_the_last(
    base_dir: Path, tmp_path: Path
) -> None:
    slot = AdapterSlot("p", base_dir, tmp_path, max_rank=8)
    v1 = adapter(BASE, seed=1)
    path = slot.prepare(v1, 1)
    assert slot.owns(path) and not slot.owns(base_dir)
    body = json.loads((path / "adapter_config.json").read_text())
    assert (body["peft_type"], body["r"], body["lora_alpha"]) == ("LORA", 4, 8.0)
    tensors, config = from_peft(load_file(path / "adapter_model.safetensors"), body)
    assert config == v1.config
    assert all(torch.equal(tensors[n], v1.tensors[n]) for n in v1.tensors)
    name = f"p-lora-{path.name}"
    assert slot.load_body(path) == {"lora_name": name, "lora_path": str(path)}
    assert slot.committed(path, v1.config) is None  # nothing to unload
    second = slot.prepare(adapter(BASE, seed=2), 2)
    assert slot.committed(second, v1.config) == name  # the replaced version's name
    third = slot.prepare(adapter(BASE, seed=3), 3)
    assert slot.committed(third, v1.config) == f"p-lora-{second.name}"
    # vLLM may read the previous version's directory again; older ones go
    assert sorted((tmp_path / "p").iterdir()) == sorted([second, third])
    assert path.name.startswith("v1-") and third.name.startswith("v3-")
    other = AdapterSlot("p", base_dir, tmp_path / "x", max_rank=8).prepare(v1, 1)
    assert other.name != path.name  # another slot on the same server: other names


@pytest.mark.parametrize(
    ("make", "field_name"),
    [
        (lambda: adapter(random_model(TINY_CONFIG, 7).hf_state_dict(), seed=1), "base_digest"),
        (lambda: adapter(BASE, seed=1, rank=16), "rank"),
    ],
)
def test_a_refused_adapter_names_the_field_and_writes_nothing(
    base_dir: Path, tmp_path: Path, make, field_name: str
) -> None:
    slot = AdapterSlot("p", base_dir, tmp_path, max_rank=8)
    with pytest.raises(AdapterError) as bad:
        slot.prepare(make(), 1)
    assert bad.value.field == field_name
    assert not (tmp_path / "p").exists()


def test_an_adapter_on_the_embedding_is_refused_naming_target_modules(
    base_dir: Path, tmp_path: Path
) -> None:
    emb = BASE["model.embed_tokens.weight"]
    tensors = {
        "model.embed_tokens.lora_A.weight": torch.zeros(4, emb.shape[1]),
        "model.embed_tokens.lora_B.weight": torch.zeros(emb.shape[0], 4),
    }
    config = AdapterConfig(
        rank=4, alpha=8.0, targets=("embed_tokens",), base_digest=base_digest(BASE)
    )
    with pytest.raises(AdapterError) as bad:
        AdapterSlot("p", base_dir, tmp_path, max_rank=8).prepare(AdapterVersion(config, tensors), 1)
    assert bad.value.field == "target_modules"


def test_an_adapter_of_another_shape_than_the_one_served_is_refused(
    base_dir: Path, tmp_path: Path
) -> None:
    slot = AdapterSlot("p", base_dir, tmp_path, max_rank=16)
    v1 = adapter(BASE, seed=1)
    slot.committed(slot.prepare(v1, 1), v1.config)
    with pytest.raises(AdapterError) as bad:
        slot.prepare(adapter(BASE, seed=2, rank=8), 2)
    assert bad.value.field == "rank"


def test_server_args_pick_a_rank_vllm_accepts_and_keep_what_is_given() -> None:
    assert server_args(4, []) == ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "1"]
    assert server_args(17, ["--enable-lora"]) == ["--max-lora-rank", "32", "--max-loras", "1"]
    assert server_args(8, ["--max-lora-rank=64", "--max-loras", "2"]) == ["--enable-lora"]
    with pytest.raises(InvalidArgument, match=r"trainer\.lora\.rank"):
        server_args(1024, [])


def test_a_vllm_engine_without_an_adapter_slot_refuses_adapter_versions() -> None:
    """No --enable-lora: the RaaS backend sees serves_adapters False, and the engine itself
    refuses the version before it calls the server (nothing listens at its address)."""
    from astra.engine.http import VLLMEngine
    from astra.engine.tokenizer import CharTokenizer
    from astra.errors import FailedPrecondition

    async def body() -> None:
        engine = VLLMEngine("http://127.0.0.1:9", "policy", "p", CharTokenizer())
        try:
            assert not engine.serves_adapters
            with pytest.raises(FailedPrecondition) as bad:
                await engine.swap_weights({"p": 1}, {"p": adapter(BASE, seed=1)})
            assert bad.value.reason == "ADAPTER_UNSUPPORTED" and engine.version("p") == 0
        finally:
            await engine.close()

    asyncio.run(asyncio.wait_for(body(), 30))
