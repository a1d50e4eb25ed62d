"""Keeps one RaaS instance registered with Dataflow: register, heartbeat, re-register, leave.

`Registrar` registers with backoff until Dataflow answers, then heartbeats
every `heartbeat_interval` Dataflow returns (free slots, versions held,
pending results). A heartbeat answered NOT_FOUND means Dataflow restarted or
dropped the instance: it registers again by itself. Any other failure is
retried, with backoff, forever; results are never touched here (they stay in
the ResultStore until AckResults), so an unreachable Dataflow loses nothing.
On stop it deregisters, best effort.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter
from typing import Protocol

import grpc

from astra.clients.dataflow import DataflowClient
from astra.common.v1 import version_pb2
from astra.dataflow.v1 import dataflow_service_pb2 as df_pb
from astra.waits import cancel_and_wait

log = logging.getLogger(__name__)

CONTRACT_VERSION = "1.0.0"


class InstanceView(Protocol):
    """What the Registrar reports about the instance (RolloutServicer implements it)."""

    instance_id: str
    capacity: int

    @property
    def policy_ids(self) -> list[str]: ...
    @property
    def workflows(self) -> list[str]: ...
    @property
    def loaded_versions(self) -> dict[str, int]: ...
    @property
    def free_slots(self) -> int: ...
    @property
    def pending_results(self) -> int: ...


def _versions(view: InstanceView) -> list[version_pb2.PolicyVersion]:
    """What it holds, by counter and identity (a view without identities: counters only)."""
    ids = getattr(view, "loaded_version_ids", {})
    return [
        version_pb2.PolicyVersion(policy_id=p, version=v, version_id=ids.get(p, ""))
        for p, v in sorted(view.loaded_versions.items())
    ]


class Registrar:
    def __init__(
        self,
        dataflow_address: str,
        view: InstanceView,
        address: str,
        *,
        labels: dict[str, str] | None = None,
        initial_backoff_s: float = 0.2,
        max_backoff_s: float = 5.0,
        call_timeout_s: float = 5.0,
    ) -> None:
        self.dataflow_address = dataflow_address
        self.view = view
        self.address = address
        self.labels = dict(labels or {})
        self.initial_backoff_s = initial_backoff_s
        self.max_backoff_s = max_backoff_s
        self.call_timeout_s = call_timeout_s
        self.client = DataflowClient(dataflow_address, timeout_s=call_timeout_s)
        self.registered = asyncio.Event()
        self.dataflow_id = ""
        self.heartbeat_interval_s = 2.0
        self.counters: Counter[str] = Counter()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="raas-registrar")

    def _register_request(self) -> df_pb.RegisterInstanceRequest:
        v = self.view
        return df_pb.RegisterInstanceRequest(
            instance_id=v.instance_id,
            address=self.address,
            capacity=v.capacity,
            policy_ids=v.policy_ids,
            workflows=v.workflows,
            labels=self.labels,
            loaded_versions=_versions(v),
            contract_version=CONTRACT_VERSION,
            incarnation=getattr(v, "incarnation", ""),
        )

    def _heartbeat_request(self) -> df_pb.HeartbeatInstanceRequest:
        v = self.view
        return df_pb.HeartbeatInstanceRequest(
            instance_id=v.instance_id,
            free_slots=max(0, v.free_slots),
            loaded_versions=_versions(v),
            pending_results=v.pending_results,
        )

    def _interval(self, resp) -> None:
        if resp.HasField("heartbeat_interval") and resp.heartbeat_interval.ToNanoseconds() > 0:
            self.heartbeat_interval_s = resp.heartbeat_interval.ToNanoseconds() / 1e9
        if resp.dataflow_id and resp.dataflow_id != self.dataflow_id:
            if self.dataflow_id:
                log.info("Dataflow changed: %s -> %s", self.dataflow_id, resp.dataflow_id)
            self.dataflow_id = resp.dataflow_id

    async def _run(self) -> None:
        backoff = self.initial_backoff_s
        while True:
            try:
                if not self.registered.is_set():
                    resp = await self.client.register_instance(self._register_request())
                    self._interval(resp)
                    self.registered.set()
                    self.counters["registrations"] += 1
                    log.info(
                        "registered %s with Dataflow %s", self.view.instance_id, self.dataflow_id
                    )
                else:
                    await asyncio.sleep(self.heartbeat_interval_s)
                    self._interval(await self.client.heartbeat_instance(self._heartbeat_request()))
                    self.counters["heartbeats"] += 1
                backoff = self.initial_backoff_s
            except grpc.aio.AioRpcError as exc:
                if self.registered.is_set() and exc.code() is grpc.StatusCode.NOT_FOUND:
                    log.warning("Dataflow forgot %s: registering again", self.view.instance_id)
                    self.registered.clear()
                    self.counters["reregistrations"] += 1
                    continue
                self.counters["call_failures"] += 1
                unavailable = exc.code() is grpc.StatusCode.UNAVAILABLE
                if unavailable:
                    await self._reopen()
                log.log(
                    logging.INFO if unavailable else logging.WARNING,
                    "Dataflow %s: %s %s",
                    self.dataflow_address,
                    exc.code().name,
                    exc.details(),
                )
                await asyncio.sleep(backoff * random.uniform(0.8, 1.2))
                backoff = min(backoff * 2, self.max_backoff_s)
            except Exception:
                # A bug here must not end membership for good: log it and keep trying.
                self.counters["call_failures"] += 1
                log.exception("registrar step failed")
                await asyncio.sleep(backoff * random.uniform(0.8, 1.2))
                backoff = min(backoff * 2, self.max_backoff_s)

    async def _reopen(self) -> None:
        # A channel that failed to connect waits out its own reconnect backoff (up to
        # minutes); a fresh one connects on the next call, so a restarted Dataflow is
        # found within max_backoff_s.
        old, self.client = (
            self.client,
            DataflowClient(self.dataflow_address, timeout_s=self.call_timeout_s),
        )
        await old.close()

    async def stop(self, *, deregister: bool = True) -> None:
        """Stops heartbeating and, if registered, deregisters (best effort); closes the channel."""
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        if deregister and self.registered.is_set():
            try:
                await self.client.deregister_instance(self.view.instance_id, timeout_s=2.0)
                self.counters["deregistrations"] += 1
            except grpc.aio.AioRpcError as exc:
                log.warning(
                    "deregister failed (Dataflow will time the instance out): %s", exc.code()
                )
            self.registered.clear()
        await self.client.close()
