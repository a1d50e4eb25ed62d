"""An interrupted publish resumes only with the same content: one identity, one content.

A trainer killed mid-publish that restarts from an older checkpoint trains other
weights and publishes them under the same identity. The tensors the first attempt
staged must not be skipped then, or the identity would commit as a mix of two models
whose every checksum passes.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from astra.clients import weights_publish
from astra.clients.weights_publish import publish_version
from astra.clients.weights_stream import Receiver
from astra.weights.store import Store, StoreConfig
from tests.test_weights_service import run, serving
from tests.test_weights_store import FAST, bf16_model, chain_of, full_copy, same


class TrainerDied(ConnectionResetError):
    pass


def dying_after(monkeypatch: pytest.MonkeyPatch, sent: int) -> None:
    """The publisher dies while preparing its `sent`-th tensor (the ones before are staged)."""
    original = weights_publish._Preparer.get

    async def get(self, order, i):
        if i == sent:
            await asyncio.sleep(0.3)  # the staged tensors are acknowledged meanwhile
            raise TrainerDied("trainer killed")
        return await original(self, order, i)

    monkeypatch.setattr(weights_publish._Preparer, "get", get)


def source_of(directory: Path, models: dict[str, dict]) -> dict[str, str]:
    """For each tensor of a fetched version: which of `models` it equals."""
    from astra.weights.layout import load_tensors

    got = load_tensors(directory)
    return {
        n: next((k for k, m in models.items() if bytes(got[n].data) == m[n][2]), "?") for n in got
    }


@pytest.mark.parametrize("base", [False, True], ids=["raw", "delta"])
def test_a_restarted_publisher_with_other_content_replaces_the_stale_attempt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, base: bool
) -> None:
    models = chain_of(2, seed=34, size=1 << 15)
    retrained = bf16_model(99, size=1 << 15)  # another "v1": same names and shapes

    async def body() -> None:
        async with serving(tmp_path / "store") as server:
            await publish_version(server.address, "p", "v0", 0, models[0])
            against = ("v0", models[0]) if base else None
            with monkeypatch.context() as m:
                dying_after(m, 2)
                with pytest.raises(TrainerDied):
                    await publish_version(server.address, "p", "v1", 1, models[1], base=against)
            result = await publish_version(server.address, "p", "v1", 1, retrained, base=against)
            assert result.tensors_skipped == 0 and not result.already_existed
            async with Receiver(server.address, "p", tmp_path / "rx", durable=False) as rx:
                await rx.fetch("v1")
                origin = source_of(rx.current_path, {"first": models[1], "retrained": retrained})
            assert set(origin.values()) == {"retrained"}, origin

    run(body())


def test_the_same_content_still_resumes_from_what_was_staged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    models = chain_of(2, seed=35, size=1 << 15)

    async def body() -> None:
        async with serving(tmp_path / "store") as server:
            await publish_version(server.address, "p", "v0", 0, models[0])
            with monkeypatch.context() as m:
                dying_after(m, 2)
                with pytest.raises(TrainerDied):
                    await publish_version(server.address, "p", "v1", 1, models[1])
            result = await publish_version(server.address, "p", "v1", 1, models[1])
            assert result.tensors_skipped == 2 and result.tensors_sent == len(models[1]) - 2
            async with Receiver(server.address, "p", tmp_path / "rx", durable=False) as rx:
                await rx.fetch("v1")
                assert same(rx.current_path, models[1])

    run(body())


def test_an_in_process_publish_replaces_a_stale_streamed_attempt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    models = chain_of(2, seed=36, size=1 << 15)
    retrained = bf16_model(98, size=1 << 15)

    async def body() -> None:
        async with serving(tmp_path / "store") as server:
            await publish_version(server.address, "p", "v0", 0, models[0])
            with monkeypatch.context() as m:
                dying_after(m, 2)
                with pytest.raises(TrainerDied):
                    await publish_version(server.address, "p", "v1", 1, models[1])

    run(body())
    store = Store(tmp_path / "store", StoreConfig(**FAST))
    record, existed = store.publish("p", "v1", 1, retrained)
    assert not existed and record.identity == "v1"
    assert same(full_copy(store, "p", "v1"), retrained)
