"""The registration checks of `astra raas check --as-dataflow`: what a RaaS tells Dataflow.

A set of checks on astra.clients.raas_check_session.CheckSession, joined in
astra.clients.raas_check.RaasChecker. The checker serves a DataflowService of its own
(astra.servers.raas_registration_check) that the instance registers with; each call is in
`options.recording` (astra.raas.registration_record.Recording). The rules, from
dataflow_service.proto:
- RegisterInstance carries an instance id, capacity >= 1, the policies and workflows served
  and a contract version of major 1, and claims only the versions it holds, by counter AND
  identity: what the instance's own GetStatus reports (`registers`,
  `registration_matches_status`);
- HeartbeatInstance comes every interval Dataflow returned, with 0 <= free_slots <=
  capacity and the versions held now (`heartbeats`), which after a LoadWeights are the loaded
  version's counter and identity (`claims_loaded_version`);
- a heartbeat answered NOT_FOUND is followed by RegisterInstance again, from the same
  process: the same instance id and incarnation, claiming what it holds
  (`reregisters_on_not_found`).
"""

from __future__ import annotations

import time
from typing import Any

from astra.clients.raas_check_session import CheckSession
from astra.clients.raas_rules import CheckFailed, Skipped
from astra.raas.registration_record import Call, Recording


def claims(versions: Any) -> set[tuple[str, int, str]]:
    """(policy, counter, identity); an empty identity read as the decimal counter."""
    return {(v.policy_id, v.version, v.version_id or str(v.version)) for v in versions}


def shown(c: set[tuple[str, int, str]]) -> str:
    return ", ".join(f"{p} {v} {i!r}" for p, v, i in sorted(c)) or "none"


class RegistrationChecks(CheckSession):
    def _recording(self) -> Recording:
        rec = self.options.recording
        if rec is None:
            raise Skipped("needs --as-dataflow (the checker acts as the instance's Dataflow)")
        return rec

    def _at_address(self, call: Call) -> bool:
        return call.request.address == self.address

    def _ours(self, call: Call) -> bool:
        return call.request.instance_id == self._registered().request.instance_id

    def _registered(self) -> Call:
        rec = self._recording()
        mine = [c for c in rec.of("register") if self._at_address(c)]
        if not mine:
            raise Skipped("the instance never registered")
        return mine[-1]

    async def _status_claims(self) -> set[tuple[str, int, str]]:
        return claims((await self.client.get_status()).loaded_versions)

    async def _matches_status(self, call: Call, what: str) -> None:
        held = await self._status_claims()
        if claims(call.request.loaded_versions) != held:
            raise CheckFailed(
                f"{what} claims {shown(claims(call.request.loaded_versions))}; the instance's "
                f"GetStatus says it holds {shown(held)}"
            )

    async def registers(self) -> str:
        rec = self._recording()
        call = await rec.wait_for(
            "register", self.options.register_timeout_s, where=self._at_address
        )
        if call is None:
            raise CheckFailed(
                f"no RegisterInstance with address {self.address} within "
                f"{self.options.register_timeout_s:.0f} s"
            )
        r = call.request
        bad = []
        if not 1 <= len(r.instance_id) <= 128:
            bad.append(f"instance_id {r.instance_id!r}")
        if r.capacity < 1:
            bad.append(f"capacity {r.capacity}")
        if not r.policy_ids or not r.workflows:
            bad.append("no policy_ids" if not r.policy_ids else "no workflows")
        if r.contract_version.split(".")[0] != "1":
            bad.append(f"contract_version {r.contract_version!r}")
        if bad:
            raise CheckFailed("RegisterInstance: " + ", ".join(bad))
        return (
            f"{r.instance_id}: capacity {r.capacity}, policies {list(r.policy_ids)}, "
            f"claims {shown(claims(r.loaded_versions))}"
        )

    async def registration_matches_status(self) -> str:
        r = self._registered().request
        s = await self.client.get_status()
        if r.capacity != s.capacity:
            raise CheckFailed(f"registered capacity {r.capacity}, GetStatus says {s.capacity}")
        for name in ("policy_ids", "workflows"):
            if set(getattr(r, name)) != set(getattr(s, name)):
                raise CheckFailed(
                    f"registered {name} {sorted(getattr(r, name))}, GetStatus says "
                    f"{sorted(getattr(s, name))}"
                )
        await self._matches_status(self._registered(), "RegisterInstance")
        return f"capacity, policies, workflows and versions ({shown(await self._status_claims())})"

    async def heartbeats(self) -> str:
        rec, reg = self._recording(), self._registered()
        wait = 3 * rec.interval_s + 2.0
        beats = await self._beats(reg.at, 2, wait)
        if len(beats) < 2:
            raise CheckFailed(
                f"{len(beats)} heartbeat(s) in {wait:.1f} s after registering, with an interval "
                f"of {rec.interval_s:.1f} s"
            )
        for b in beats:
            h = b.request
            if not 0 <= h.free_slots <= reg.request.capacity or h.pending_results < 0:
                raise CheckFailed(
                    f"heartbeat free_slots {h.free_slots}, pending_results {h.pending_results} "
                    f"(capacity {reg.request.capacity})"
                )
        await self._matches_status(beats[-1], "a heartbeat")
        gap = beats[1].at - beats[0].at
        return f"every {gap:.2f} s (interval {rec.interval_s:.1f} s), claims as GetStatus"

    async def _beats(self, since: float, n: int, wait_s: float) -> list[Call]:
        return await self._recording().wait_for_many("heartbeat", n, wait_s, since, self._ours)

    async def claims_loaded_version(self) -> str:
        rec = self._recording()
        if self.loaded is None:
            raise Skipped("needs the load_weights check (--weights and --version)")
        want = (self.policy, self.loaded.version, self.loaded.version_id)
        # the second heartbeat from now: the first may have been built before the load
        beats = await self._beats(time.monotonic(), 2, 3 * rec.interval_s + 2.0)
        if len(beats) < 2:
            raise CheckFailed("no heartbeat after LoadWeights")
        got = claims(beats[-1].request.loaded_versions)
        if want not in got:
            raise CheckFailed(
                f"after loading {want[2]!r} (version {want[1]}), a heartbeat claims {shown(got)}"
            )
        return f"a heartbeat claims {shown({want})}"

    async def reregisters_on_not_found(self) -> str:
        rec, before = self._recording(), self._registered()
        rec.forget_at_next_heartbeat()
        t0 = time.monotonic()
        refused = await rec.wait_for(
            "heartbeat", 3 * rec.interval_s + 2.0, since=t0, where=lambda c: c.answered != "OK"
        )  # fmt: skip
        if refused is None:
            raise CheckFailed("no heartbeat came to be answered NOT_FOUND")
        wait = 3 * rec.interval_s + 5.0
        again = await rec.wait_for("register", wait, since=refused.at, where=self._at_address)
        if again is None:
            raise CheckFailed(f"no RegisterInstance within {wait:.0f} s of a NOT_FOUND heartbeat")
        r, old = again.request, before.request
        if (r.instance_id, r.incarnation) != (old.instance_id, old.incarnation):
            raise CheckFailed(
                f"registered again as {r.instance_id!r} incarnation {r.incarnation!r}, was "
                f"{old.instance_id!r} {old.incarnation!r}: the same process keeps both (a new "
                "incarnation tells Dataflow its groups died)"
            )
        await self._matches_status(again, "the new RegisterInstance")
        return f"registered again {again.at - refused.at:.2f} s after NOT_FOUND, same incarnation"
