"""The adapter version format: config round trip, names, shapes and the base's digest."""

from __future__ import annotations

import pytest
import torch

from astra.engine.tiny import tiny_model
from astra.lora.format import (
    AdapterConfig,
    AdapterError,
    base_digest,
    check_base,
    from_peft,
    pair_tensors,
    target_modules,
    tensor_names,
    to_peft,
)


def _config(**over):
    kw = {"rank": 4, "alpha": 8.0, "targets": ("q_proj", "v_proj"), "base_digest": "blake3:ab"}
    kw.update(over)
    return AdapterConfig(**kw)


def test_config_round_trips_through_json_and_scale_is_alpha_over_rank():
    c = _config(dropout=0.1)
    back = AdapterConfig.from_json(c.to_json())
    assert back == c
    assert back.scale == 2.0


@pytest.mark.parametrize(
    ("over", "field_name"),
    [
        ({"rank": 0}, "rank"),
        ({"alpha": 0.0}, "alpha"),
        ({"dropout": 1.0}, "dropout"),
        ({"targets": ()}, "target_modules"),
        ({"targets": ("q proj",)}, "target_modules"),
        ({"base_digest": ""}, "base_digest"),
    ],
)
def test_bad_config_names_the_field(over, field_name):
    with pytest.raises(AdapterError) as e:
        _config(**over)
    assert e.value.field == field_name


def test_from_json_refuses_another_format_and_missing_keys():
    with pytest.raises(AdapterError, match="astra_adapter"):
        AdapterConfig.from_json('{"rank": 2}')
    with pytest.raises(AdapterError, match="base_digest"):
        AdapterConfig.from_json(
            '{"astra_adapter": 1, "rank": 2, "alpha": 2, "target_modules": ["q_proj"]}'
        )


def test_target_modules_finds_every_layer_and_refuses_an_unknown_name():
    names = tiny_model().hf_state_dict().keys()
    mods = target_modules(names, ["q_proj", "down_proj"])
    assert mods == sorted(
        [f"model.layers.{i}.self_attn.q_proj" for i in range(2)]
        + [f"model.layers.{i}.mlp.down_proj" for i in range(2)]
    )
    with pytest.raises(AdapterError, match="qkv_proj"):
        target_modules(names, ["q_proj", "qkv_proj"])


def test_pair_tensors_checks_shapes_against_the_base():
    base = {k: tuple(v.shape) for k, v in tiny_model().hf_state_dict().items()}
    mod = "model.layers.0.self_attn.q_proj"
    out_f, in_f = base[mod + ".weight"]
    a, b = tensor_names(mod)
    c = _config()
    good = {a: torch.zeros(4, in_f), b: torch.zeros(out_f, 4)}
    assert set(pair_tensors(good, base, c)) == {mod}
    with pytest.raises(AdapterError, match="lora_A is"):
        pair_tensors({a: torch.zeros(3, in_f), b: torch.zeros(out_f, 4)}, base, c)
    with pytest.raises(AdapterError, match="only lora_A"):
        pair_tensors({a: torch.zeros(4, in_f)}, base, c)
    with pytest.raises(AdapterError, match="not an adapter tensor"):
        pair_tensors({mod + ".weight": torch.zeros(out_f, in_f)}, base, c)
    with pytest.raises(AdapterError, match="not a linear layer"):
        pair_tensors(
            {
                "model.nope.lora_A.weight": torch.zeros(4, 2),
                "model.nope.lora_B.weight": torch.zeros(2, 4),
            },
            base,
            c,
        )


def test_base_digest_ignores_the_compute_dtype_but_sees_one_changed_element():
    state = tiny_model().hf_state_dict()
    d = base_digest(state)
    assert d.startswith("blake3:")
    # bf16 round trip of values that are already bf16-exact gives the same digest
    exact = {k: v.to(torch.bfloat16).to(torch.float32) for k, v in state.items()}
    assert base_digest({k: v.to(torch.bfloat16) for k, v in exact.items()}) == base_digest(exact)
    changed = dict(state)
    w = changed["model.layers.0.self_attn.q_proj.weight"].clone()
    w[0, 0] += 1.0
    changed["model.layers.0.self_attn.q_proj.weight"] = w
    assert base_digest(changed) != d
    check_base(_config(base_digest=d), d)
    with pytest.raises(AdapterError) as e:
        check_base(_config(base_digest=d), base_digest(changed))
    assert e.value.field == "base_digest"


def test_peft_layout_round_trips_names_tensors_and_config():
    c = _config(dropout=0.05)
    a, b = tensor_names("model.layers.0.self_attn.q_proj")
    tensors = {a: torch.randn(4, 64), b: torch.randn(64, 4)}
    peft, body = to_peft(tensors, c, base_name="/models/base")
    assert set(peft) == {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
    }
    assert body["peft_type"] == "LORA" and body["r"] == 4 and body["lora_alpha"] == 8.0
    assert body["target_modules"] == ["q_proj", "v_proj"] and body["lora_dropout"] == 0.05
    assert body["bias"] == "none" and body["fan_in_fan_out"] is False
    assert body["base_model_name_or_path"] == "/models/base"
    back, config = from_peft(peft, body)
    assert config == c
    assert set(back) == set(tensors) and all(torch.equal(back[n], tensors[n]) for n in tensors)


def test_peft_conversion_refuses_foreign_names_naming_the_field():
    with pytest.raises(AdapterError) as bad:
        to_peft({"model.norm.weight": torch.ones(3)}, _config())
    assert bad.value.field == "tensors"
    with pytest.raises(AdapterError) as bad:
        from_peft({"model.x.lora_A.weight": torch.ones(1, 1)}, {"r": 1, "lora_alpha": 1})
    assert bad.value.field == "tensors"
    with pytest.raises(AdapterError) as bad:
        from_peft({}, {"r": 0, "lora_alpha": 1, "target_modules": ["q_proj"]})
    assert bad.value.field == "rank"
