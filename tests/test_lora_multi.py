"""Many LoRA policies on one shared base in the built-in engine (astra.lora.multi): each policy
matches its own merged model, mixed rows apply each row's adapter, a swap of one policy's
adapter leaves the other's outputs bit-identical, and the base's parameters exist once.
"""

from __future__ import annotations

import asyncio

import numpy as np
import torch

from astra.engine.tiny import load_model
from astra.engine.torch_engine import TorchEngine
from astra.lora.multi import BasePool, PolicyModel, SharedBase
from tests.test_lora_serving import PROMPT, adapter, greedy, merged_model, run


def test_policies_on_one_base_each_match_their_merged_model_and_share_its_parameters():
    async def body():
        (ma, tok), (mb, _), (mc, _) = load_model("tiny"), load_model("tiny"), load_model("tiny")
        base = {k: v.clone() for k, v in ma.hf_state_dict().items()}
        va, vb = adapter(base, seed=1), adapter(base, seed=2)
        engine = TorchEngine({"a": (ma, tok), "b": (mb, tok), "full": (mc, tok)})
        refs = {p: TorchEngine({p: merged_model(base, v)}) for p, v in (("a", va), ("b", vb))}
        try:
            before = engine.held_bytes()
            await engine.swap_weights({"a": 3, "b": 7}, {"a": va, "b": vb})
            after = engine.held_bytes()
            got = await asyncio.gather(greedy(engine, "a"), greedy(engine, "b"))
            want = [await greedy(refs["a"], "a"), await greedy(refs["b"], "b")]
            models = {p: b.model for p, b in engine._sched.current.items()}
            extra = sum(t.numel() * t.element_size() for v in (va, vb) for t in v.tensors.values())
            await engine.swap_weights({"a": 4}, {"a": adapter(base, seed=5)})  # a's next only
            later = await asyncio.gather(greedy(engine, "a"), greedy(engine, "b"))
        finally:
            await engine.close()
            for r in refs.values():
                await r.close()
        return before, after, got, want, models, extra, later

    before, after, got, want, models, extra, later = run(body)
    for (tokens, logprobs, versions), (wt, wl, _), v in zip(got, want, (3, 7), strict=True):
        assert tokens == wt and set(versions) == {v}
        np.testing.assert_allclose(logprobs, wl, atol=1e-4)
    assert got[0][0] != got[1][0]
    assert later[1] == got[1]  # b: the same tokens, log-probs (bit-identical) and version 7
    assert set(later[0][2]) == {4} and later[0][:2] != got[0][:2]
    a, b = models["a"], models["b"]
    assert isinstance(a, PolicyModel) and isinstance(b, PolicyModel)
    assert a.shared is b.shared and not isinstance(models["full"], PolicyModel)
    ptrs = {p.data_ptr() for p in a.shared.model.parameters()}
    assert ptrs.isdisjoint(p.data_ptr() for p in models["full"].parameters())
    one_model = sum(p.numel() * p.element_size() for p in models["full"].parameters())
    assert before == 3 * one_model  # three own copies of the base
    assert after == 2 * one_model + extra  # two bases (shared + full policy's) + adapters


@torch.no_grad()
def test_mixed_rows_apply_each_rows_adapter_and_a_swap_leaves_the_other_bit_identical():
    model, _ = load_model("tiny")
    base = {k: v.clone() for k, v in model.hf_state_dict().items()}
    va, vb, va2 = adapter(base, seed=1), adapter(base, seed=2), adapter(base, seed=3)
    pool = BasePool()
    pa = pool.plan_shared("a", model, va).install()
    pb = pool.plan_shared("b", model, vb).install()
    assert pa.shared is pb.shared and len(pool.bases) == 1
    shared: SharedBase = pa.shared
    ids = torch.tensor([PROMPT, PROMPT[::-1], PROMPT, PROMPT[::-1]])
    rows = ["a", "b", "b", "a"]
    with shared.serving(rows):
        mixed = shared.model.forward_full(ids).log_softmax(-1)
    for i, policy in enumerate(rows):
        ref, _ = merged_model(base, va if policy == "a" else vb)
        want = ref.forward_full(ids[i : i + 1]).log_softmax(-1)[0]
        torch.testing.assert_close(mixed[i], want, atol=1e-4, rtol=0)
        assert mixed[i].argmax(-1).tolist() == want.argmax(-1).tolist()
    pool.plan_shared("a", pa, va2).install()  # a's next version
    with shared.serving(rows):
        swapped = shared.model.forward_full(ids).log_softmax(-1)
    assert torch.equal(swapped[1:3], mixed[1:3])  # b's rows: bit-identical
    assert not torch.allclose(swapped[0], mixed[0])  # a's rows: the new adapter
    with shared.serving("b"):
        alone = shared.model.forward_full(ids[1:3]).log_softmax(-1)
    torch.testing.assert_close(alone, mixed[1:3], atol=1e-5, rtol=0)
    for name, w in base.items():  # the base itself is never changed
        assert torch.equal(shared.model.hf_state_dict()[name], w), name


def test_finish_old_keeps_a_copy_per_policy_and_serves_the_adapter():
    async def body():
        model, tok = load_model("tiny")
        base = {k: v.clone() for k, v in model.hf_state_dict().items()}
        version = adapter(base, seed=1)
        engine = TorchEngine({"p": (model, tok)}, on_swap="finish_old")
        reference = TorchEngine({"p": merged_model(base, version)})
        try:
            await engine.swap_weights({"p": 1}, {"p": version})
            got, want = await greedy(engine, "p"), await greedy(reference, "p")
            served = engine._sched.current["p"].model
        finally:
            await engine.close()
            await reference.close()
        return got, want, served

    got, want, served = run(body)
    assert got[0] == want[0] and set(got[2]) == {1}
    np.testing.assert_allclose(got[1], want[1], atol=1e-4)
    assert not isinstance(served, PolicyModel)
