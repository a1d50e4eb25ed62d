"""Adapter versions stream and relay like full ones: a chain of LoRA versions published to an
origin WeightService, relayed by a receiver into a second service, fetched by a leaf (in memory,
as the torch-engine RaaS fetches) as deltas, each arriving bit-exact with its adapter_config.json,
so the RaaS loader makes an AdapterVersion of it."""

from __future__ import annotations

import numpy as np

from astra.clients.weights_stream import Receiver, publish_version
from astra.lora.format import AdapterConfig, tensor_names
from astra.lora.serving import AdapterVersion, as_version
from astra.servers.weights_serve import start_weights
from astra.weights.store import Store, StoreConfig
from tests.test_weights_service import run, serving

MODULES = ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj")
CONFIG = AdapterConfig(rank=4, alpha=8.0, targets=("q_proj", "down_proj"), base_digest="b" * 64)


def adapter(step: int) -> dict[str, tuple[str, list[int], bytes]]:
    """Version `step` of a rank-4 adapter: B grows from zero, A fixed, as LoRA training does."""
    rng = np.random.default_rng(0)
    out = {}
    for m in MODULES:
        a_name, b_name = tensor_names(m)
        a = rng.standard_normal((4, 64)).astype(np.float32)
        b = (np.random.default_rng(step).standard_normal((64, 4)) * 1e-3 * step).astype(np.float32)
        out[a_name] = ("F32", [4, 64], a.tobytes())
        out[b_name] = ("F32", [64, 4], b.tobytes())
    return out


def test_adapter_versions_relay_as_deltas_and_arrive_whole(tmp_path) -> None:
    files = {"adapter_config.json": CONFIG.to_json().encode()}

    async def body() -> None:
        async with serving(tmp_path / "origin") as origin:
            relay_store = Store(tmp_path / "relay-store", StoreConfig(durable=False))
            relay_server = await start_weights(tmp_path / "relay-store", store=relay_store)
            relay = Receiver(
                origin.address, "p", tmp_path / "relay", relay=relay_store, durable=False
            )
            leaf = Receiver(relay_server.address, "p", None, in_memory=True)
            try:
                plans = []
                for i in range(4):
                    tensors = adapter(i)
                    await publish_version(origin.address, "p", f"a{i}", i, tensors, files)
                    await relay.fetch()
                    got = await leaf.fetch()
                    plans.append(got.plan)
                    held = leaf.current
                    assert {n: bytes(held[n].data) for n in held} == {
                        n: t[2] for n, t in tensors.items()
                    }
                    version = as_version(dict(held.items()), held.files.get("adapter_config.json"))
                    assert isinstance(version, AdapterVersion) and version.config == CONFIG
                assert plans == ["full", "delta", "delta", "delta"]
            finally:
                await relay.close()
                await leaf.close()
                await relay_server.stop(0)

    run(body())
