"""A small trainer with switches, each breaking one rule of the trainer's contract.

`python -m astra.testing.broken_trainer --dataflow A --weights B --policy P [--switch S]`
fetches one-group batches from a DataflowService, "trains" (sleeps a moment),
acknowledges, publishes a one-tensor version to a WeightService and announces it,
until it is stopped. With no switch it keeps every rule astra.trainer.contract_rules
checks; each entry of SWITCHES breaks the rule it names (the test of `astra trainer
check` runs each one and expects exactly that rule to fail). A real client of both
services (astra.clients.dataflow, astra.clients.weights*); it never touches a store.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import secrets
from typing import Any

import grpc
import numpy as np

from astra.clients.dataflow import DataflowClient
from astra.clients.weights import WeightClient
from astra.clients.weights_publish import publish_version
from astra.weights.checksum import adler32_hex
from astra.weights.v1 import weight_service_pb2 as wpb

log = logging.getLogger("broken_trainer")

# switch -> the rule of astra.trainer.contract_rules it breaks
SWITCHES = {
    "stall": "trains",  # fetches and acknowledges, never publishes
    "new_request_id_on_retry": "retry_reuses_request_id",
    "retry_spent_request_id": "spent_request_id_replaced",  # step 2 asks step 1's id twice
    "late_ack": "batches_acknowledged_in_lease",  # the first batch, after its lease
    "ack_bad_reason": "acks_name_delivered_batches",  # untrained_reason "not trained!" first
    "announce_before_ack": "ack_before_announce",
    "skip_version": "versions_step_by_one",  # the second step publishes version + 2
    "announce_before_publish": "announce_after_commit",
    "corrupt_checksum": "publish_checksums_correct",  # the first publish: a wrong Adler-32
    "no_resume_flag": "restart_resumes",  # after a restart: the repeat without `resumed`
}


def _tensors(version: int) -> dict:
    data = np.full(8, float(version), np.float32).tobytes()
    return {"w": ("F32", (8,), memoryview(data))}


class BrokenTrainer:
    def __init__(self, dataflow: str, weights: str, policy: str, switch: str, lease_s: float):
        self.dataflow = dataflow
        self.weights, self.policy, self.switch, self.lease_s = weights, policy, switch, lease_s
        self.token, self.attempt = secrets.token_hex(3), 0

    async def publish(self, version: int) -> None:
        try:
            await publish_version(
                self.weights, self.policy, str(version), version, _tensors(version)
            )
        except Exception as exc:  # refused: the next step publishes the next version
            log.warning("publish %d failed: %s", version, exc)

    async def publish_corrupt(self, version: int) -> None:
        """One raw stream whose tensor's Adler-32 is not its bytes': the service refuses it."""
        _, shape, view = _tensors(version)["w"]
        bad = "0" * 8 if adler32_hex(view) != "0" * 8 else "00000001"
        parts = [
            wpb.PublishVersionRequest(header=wpb.PublishHeader(
                policy_id=self.policy, version_id=str(version), version=version, num_tensors=1)),
            wpb.PublishVersionRequest(tensor=wpb.TensorHeader(
                name="w", dtype="F32", shape=list(shape), adler32=bad, size_bytes=view.nbytes,
                encoding=wpb.TENSOR_ENCODING_RAW, encoded_size_bytes=view.nbytes)),
            wpb.PublishVersionRequest(chunk=wpb.TensorChunk(offset=0, data=bytes(view))),
            wpb.PublishVersionRequest(commit=wpb.PublishCommit(num_tensors=1)),
        ]  # fmt: skip
        try:
            async for resp in self.wc.stub.PublishVersion(iter(parts), timeout=30):
                log.info("publish answered %s", resp.WhichOneof("part"))
        except grpc.aio.AioRpcError as exc:
            log.info("corrupt publish refused: %s", exc.code().name)

    async def announce(self, version: int, **more: Any) -> None:
        try:
            await self.df.announce_version(self.policy, version, self.weights, **more)
        except grpc.aio.AioRpcError as exc:
            log.warning("announce %d refused: %s %s", version, exc.code().name, exc.details())

    async def fetch(self, version: int, step: int, last_rid: str) -> tuple[str, str]:
        rid = f"{self.token}-v{version + 1}-a{self.attempt}"
        again = 2 if self.switch == "retry_spent_request_id" and step == 2 else 0
        rid = last_rid if again else rid
        while True:
            try:
                header, _, _ = await self.df.fetch_batch(
                    self.policy, 1, rid, trainer_id="broken", max_wait_s=1.0,
                    trainer_version=version,
                )  # fmt: skip
                return header.batch_id, rid
            except (grpc.aio.AioRpcError, ConnectionError) as exc:
                code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else None
                if code in (None, grpc.StatusCode.UNAVAILABLE) and (
                    self.switch != "new_request_id_on_retry"
                ):
                    await asyncio.sleep(0.05)
                    continue  # the same request_id: the same batch
                if again:
                    again -= 1
                    continue  # a spent id asked again
                log.info("fetch %s: %s; a new request id", rid, code)
                self.attempt += 1
                rid = f"{self.token}-v{version + 1}-a{self.attempt}"

    async def ack(self, batch_id: str, step: int) -> None:
        if self.switch == "late_ack" and step == 1:
            await asyncio.sleep(self.lease_s + 0.5)
        if self.switch == "ack_bad_reason" and step == 1:
            try:
                await self.df.ack_batch(batch_id, untrained_reason="not trained!")
            except grpc.aio.AioRpcError as exc:
                log.info("ack refused: %s", exc.code().name)
        try:
            await self.df.ack_batch(batch_id)
        except grpc.aio.AioRpcError as exc:
            log.warning("ack %s refused: %s", batch_id, exc.code().name)

    async def release(self, version: int, step: int) -> None:
        if self.switch == "announce_before_publish":
            await self.announce(version)
        if self.switch == "corrupt_checksum" and step == 1:
            await self.publish_corrupt(version)
        await self.publish(version)
        if self.switch != "announce_before_publish":
            await self.announce(version)

    async def run(self) -> None:
        self.df, self.wc = DataflowClient(self.dataflow), WeightClient(self.weights)
        status = await self.df.get_status()
        version = next(p.current_version for p in status.policies if p.policy_id == self.policy)
        latest = await self._latest()
        if latest is None:  # a first start
            await self.publish(0)
            await self.announce(0)
        else:  # a restart: versions published but not announced first, as Astra's trainer does
            for v in range(version + 1, latest + 1):
                await self.announce(v)
            version = max(version, latest)
            if self.switch == "no_resume_flag":
                await self.announce(version)
            else:
                await self.announce(version, resumed=True, resumed_from_version=version)
        step, last_rid = 0, ""
        while True:
            step += 1
            batch_id, last_rid = await self.fetch(version, step, last_rid)
            await asyncio.sleep(0.05)  # the step
            nxt = version + (2 if self.switch == "skip_version" and step == 2 else 1)
            if self.switch == "announce_before_ack":
                await self.release(nxt, step)
            await self.ack(batch_id, step)
            if self.switch == "stall":
                self.attempt += 1  # no step: the next batch is of the same version
                continue
            if self.switch != "announce_before_ack":
                await self.release(nxt, step)
            version = nxt

    async def _latest(self) -> int | None:
        try:
            page = await self.wc.list_versions(self.policy, page_size=1)
        except grpc.aio.AioRpcError:
            return None  # POLICY_NOT_FOUND: nothing published yet
        return page.versions[0].version if page.versions else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataflow", required=True)
    p.add_argument("--weights", required=True)
    p.add_argument("--policy", default="policy")
    p.add_argument("--switch", default="", choices=["", *SWITCHES])
    p.add_argument("--lease-s", type=float, default=3.0, help="The checker's batch lease.")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="broken_trainer %(levelname)s %(message)s")
    asyncio.run(BrokenTrainer(a.dataflow, a.weights, a.policy, a.switch, a.lease_s).run())


if __name__ == "__main__":
    main()
