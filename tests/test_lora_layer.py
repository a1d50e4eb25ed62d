"""The LoRA layer: its math by hand and against peft's, injection, freezing, state and merge."""

from __future__ import annotations

import math

import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import inject_adapter_in_model
from torch import nn

from astra.engine.tiny import tiny_model
from astra.lora.format import AdapterConfig, AdapterError, target_modules, tensor_names
from astra.lora.layer import (
    Adapter,
    LoraLinear,
    adapter_state,
    initial_tensors,
    inject,
    load_adapter,
    lora_layers,
    merge,
)


def _hand_layer() -> LoraLinear:
    layer = LoraLinear(2, 2, bias=True, rank=1, alpha=2.0)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
        layer.bias.copy_(torch.tensor([0.5, -0.5]))
        layer.lora_A.weight.copy_(torch.tensor([[1.0, 1.0]]))
        layer.lora_B.weight.copy_(torch.tensor([[2.0], [0.0]]))
    return layer


def _adapter(targets=("q_proj", "v_proj"), rank=4, alpha=8.0, dropout=0.0) -> Adapter:
    names = tiny_model().hf_state_dict().keys()
    cfg = AdapterConfig(
        rank=rank, alpha=alpha, targets=targets, base_digest="blake3:00", dropout=dropout
    )
    return Adapter(cfg, tuple(target_modules(names, targets)))


def _adapted(adapter: Adapter, seed: int = 0):
    model = tiny_model()
    inject(model, adapter)
    shapes = {n: tuple(t.shape) for n, t in model.hf_state_dict().items()}
    start = initial_tensors(adapter, shapes, seed)
    for name, a in start.items():  # B non-zero, so the adapter changes the output
        if name.endswith("lora_B.weight"):
            start[name] = torch.randn(a.shape, generator=torch.Generator().manual_seed(1)) * 0.1
    load_adapter(model, start)
    return model.eval(), start


def test_the_output_is_the_base_plus_alpha_over_rank_times_b_a_x_by_hand():
    layer = _hand_layer()
    x = torch.tensor([[1.0, 2.0]])
    # W x + b = [5.5, 10.5]; A x = 3; B (A x) = [6, 0]; scale alpha / rank = 2
    assert layer(x).tolist() == [[17.5, 10.5]]
    state = {"m.weight": layer.weight, "m.bias": layer.bias}
    state.update({"m.lora_A.weight": layer.lora_A.weight, "m.lora_B.weight": layer.lora_B.weight})
    config = AdapterConfig(rank=1, alpha=2.0, targets=("m",), base_digest="blake3:00")
    merged = merge(state, config)
    assert set(merged) == {"m.weight", "m.bias"}
    assert merged["m.weight"].tolist() == [[5.0, 6.0], [3.0, 4.0]]  # W + 2 * B @ A


def test_a_fresh_adapter_leaves_the_output_and_only_the_adapter_trains():
    base = nn.Linear(16, 8)
    layer = LoraLinear.around(base, rank=4, alpha=8.0, dropout=0.0)
    assert layer.weight is base.weight and layer.bias is base.bias
    bound = 1 / math.sqrt(16)  # kaiming-uniform with a=sqrt(5)
    assert layer.lora_A.weight.abs().max() <= bound and layer.lora_A.weight.abs().max() > bound / 2
    assert torch.count_nonzero(layer.lora_B.weight) == 0
    x = torch.randn(3, 16)
    torch.testing.assert_close(layer(x), base(x), rtol=0, atol=0)
    layer(x).pow(2).sum().backward()
    assert layer.weight.grad is None and layer.bias.grad is None
    assert layer.lora_B.weight.grad is not None and layer.lora_B.weight.grad.abs().sum() > 0
    assert not layer.weight.requires_grad
    assert {n for n, p in layer.named_parameters() if p.requires_grad} == {
        "lora_A.weight",
        "lora_B.weight",
    }


def test_dropout_is_on_the_adapter_input_only_and_off_in_eval():
    layer = LoraLinear.around(nn.Linear(32, 8), rank=2, alpha=2.0, dropout=0.5)
    x = torch.randn(4, 32)
    base = nn.functional.linear(x, layer.weight, layer.bias)
    torch.testing.assert_close(layer.train()(x), base)  # B = 0: dropout cannot show
    with torch.no_grad():
        layer.lora_B.weight.fill_(1.0)
    torch.manual_seed(0)
    trained = layer.train()(x)
    exact = base + layer.scale * (x @ layer.lora_A.weight.T @ layer.lora_B.weight.T)
    assert not torch.allclose(trained, exact)
    torch.testing.assert_close(layer.eval()(x), exact)


def test_inject_names_tensors_as_the_format_and_freezes_the_rest():
    adapter = _adapter()
    model = tiny_model()
    inject(model, adapter)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for m in adapter.modules for n in tensor_names(m)}
    assert set(lora_layers(model)) == set(adapter.modules)
    assert "model.layers.0.self_attn.q_proj.weight" in dict(model.named_parameters())
    bad = Adapter(adapter.config, ("model.embed_tokens",))
    with pytest.raises(AdapterError) as e:
        inject(tiny_model(), bad)
    assert e.value.field == "target_modules" and "Embedding" in str(e.value)


def test_adapter_state_round_trips_and_initial_tensors_are_seeded():
    adapter = _adapter()
    model, start = _adapted(adapter)
    got = adapter_state(model.state_dict())
    assert set(got) == set(start)
    for name, value in start.items():
        assert torch.equal(got[name], value)
    shapes = {n: tuple(t.shape) for n, t in tiny_model().hf_state_dict().items()}
    one, two = initial_tensors(adapter, shapes, 3), initial_tensors(adapter, shapes, 3)
    assert all(torch.equal(one[k], two[k]) for k in one)
    other = initial_tensors(adapter, shapes, 4)
    assert not torch.equal(
        one["model.layers.0.self_attn.q_proj.lora_A.weight"],
        other["model.layers.0.self_attn.q_proj.lora_A.weight"],
    )
    with pytest.raises(AdapterError, match="not an adapter tensor"):
        load_adapter(model, {"model.norm.weight": torch.ones(64)})


def test_the_merged_model_computes_what_the_adapted_model_does():
    adapter = _adapter(("q_proj", "down_proj"))
    model, _ = _adapted(adapter)
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        adapted = model(ids)
        merged_model = tiny_model()
        merged_model.load_weights(merge(model.hf_state_dict(), adapter.config))
        merged = merged_model(ids)
        base = tiny_model()(ids)
    assert not torch.allclose(adapted, base, atol=1e-3)
    torch.testing.assert_close(merged, adapted, rtol=1e-5, atol=1e-5)


def test_the_same_a_b_w_and_x_give_peft_loras_output():
    """peft's LoRA on the same module paths of the same model, with the same A and B."""
    adapter = _adapter(("q_proj", "v_proj", "up_proj"), rank=4, alpha=12.0)
    ours, start = _adapted(adapter)
    theirs = tiny_model()
    peft_cfg = PeftLoraConfig(
        r=4, lora_alpha=12, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "up_proj"]
    )
    theirs = inject_adapter_in_model(peft_cfg, theirs)
    peft_params = dict(theirs.named_parameters())
    loaded = 0
    with torch.no_grad():
        for name, value in start.items():
            module, ab = name.rsplit(".lora_", 1)
            peft_name = f"{module}.lora_{ab[0]}.default.weight"
            peft_params[peft_name].copy_(value)
            loaded += 1
    peft_adapter = [n for n in peft_params if ".lora_" in n]
    assert loaded == len(peft_adapter) == len(start)
    theirs.eval()
    ids = torch.randint(0, 100, (3, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids), rtol=1e-5, atol=1e-5)
    x = torch.randn(5, 64)
    layer = ours.model.layers[1].self_attn.q_proj
    peft_layer = theirs.model.layers[1].self_attn.q_proj
    with torch.no_grad():
        torch.testing.assert_close(layer(x), peft_layer(x), rtol=1e-6, atol=1e-6)
    # peft draws A as we do: kaiming-uniform within 1/sqrt(in); B zeros
    fresh = inject_adapter_in_model(PeftLoraConfig(r=4, target_modules=["q_proj"]), tiny_model())
    a = fresh.model.layers[0].self_attn.q_proj.lora_A["default"].weight
    assert a.abs().max() <= 1 / math.sqrt(64)
    assert torch.count_nonzero(fresh.model.layers[0].self_attn.q_proj.lora_B["default"].weight) == 0
