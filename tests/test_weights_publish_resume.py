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
from tests.test_weights_store import FAST, FILE_STAGED, bf16_model, chain_of, full_copy, same


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


async def interrupted(monkeypatch: pytest.MonkeyPatch, *args, **kwargs) -> None:
    """A publish_version(*args, **kwargs) whose publisher dies after staging two tensors."""
    with monkeypatch.context() as m:
        dying_after(m, 2)
        with pytest.raises(TrainerDied):
            await publish_version(*args, **kwargs)


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
            await interrupted(monkeypatch, server.address, "p", "v1", 1, models[1], base=against)
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
        async with serving(tmp_path / "store", **FILE_STAGED) as server:
            await publish_version(server.address, "p", "v0", 0, models[0])
            await interrupted(monkeypatch, server.address, "p", "v1", 1, models[1])
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
            await interrupted(monkeypatch, server.address, "p", "v1", 1, models[1])

    run(body())
    store = Store(tmp_path / "store", StoreConfig(**FAST))
    record, existed = store.publish("p", "v1", 1, retrained)
    assert not existed and record.identity == "v1"
    assert same(full_copy(store, "p", "v1"), retrained)


def test_numpy_dtype_names_resume_too_and_a_restart_costs_no_attempt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The service stores safetensors names ("BF16"); a sender naming dtypes as NDArray does
    ("bfloat16") still resumes. And a stale stage found on the last allowed attempt is still
    replaced: starting over is not a failed attempt."""
    models = chain_of(2, seed=37, size=1 << 15)
    named = {n: ("bfloat16", s, b) for n, (_, s, b) in models[1].items()}
    retrained = {n: ("bfloat16", s, b) for n, (_, s, b) in bf16_model(97, size=1 << 15).items()}

    async def body() -> None:
        async with serving(tmp_path / "store", **FILE_STAGED) as server:
            await publish_version(server.address, "p", "v0", 0, models[0])
            await interrupted(monkeypatch, server.address, "p", "v1", 1, named)
            resumed = await publish_version(server.address, "p", "v1", 1, named)
            assert resumed.tensors_skipped == 2
            await interrupted(monkeypatch, server.address, "p", "v2", 2, named)
            replaced = await publish_version(
                server.address, "p", "v2", 2, retrained, max_attempts=1
            )
            assert replaced.tensors_skipped == 0 and replaced.attempts == 1
            async with Receiver(server.address, "p", tmp_path / "rx", durable=False) as rx:
                await rx.fetch("v2")
                assert same(rx.current_path, bf16_model(97, size=1 << 15))

    run(body())


def test_a_write_on_a_reset_connection_counts_as_the_service_going_away() -> None:
    import grpc

    from astra.clients.weights_publish import _transport_failed

    def error(code, details):
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)

    assert _transport_failed(error(grpc.StatusCode.UNAVAILABLE, "connection refused"))
    assert _transport_failed(error(grpc.StatusCode.INTERNAL, "Internal error from Core"))
    assert not _transport_failed(error(grpc.StatusCode.INTERNAL, "a bug in the service"))
    assert not _transport_failed(error(grpc.StatusCode.ALREADY_EXISTS, "other content"))
