"""`astra run --ray auto|ADDRESS`: the same child processes, placed on a Ray cluster.

Each child gets one Ray actor (astra.run.ray_actor), created with the child's resources:
`num_gpus` for a RaaS, a trainer or a warm-up whose device is cuda (as many as a
trainer's `--nproc`: the multi-GPU path stays torchrun/FSDP2, Ray only places the
process), one CPU otherwise; Dataflow and the WeightService prefer the
supervisor's node (soft node affinity). The actor runs the very command line a
`Child` runs, with `subprocess` on its node, in a session of its own; it keeps
the first stdout line (the address line), writes the child's stderr and the rest
of its stdout to the child's log, waits for it and signals its process group.
The child dies with its actor (PR_SET_PDEATHSIG), and the actors with the
supervisor (Ray's owner fate-sharing): nothing outlives a run.

`RayChild` has `Child`'s interface (spawn, read_address, result, wait,
signal_group, stop, tail, describe, pid, returncode, address); run.json records
each child's placement under `ray` (node id and IP, actor id, worker pid,
resources).

Addresses: a service placed by Ray listens on its node's IP
(`--host <ray.util.get_node_ip_address()>`, appended to `astra serve ...`) and
advertises it, so a child on another node can reach it; without --ray every
service keeps 127.0.0.1.

With `tls: true` the supervisor issues each child a credential for its node's IP and its role
from the run's CA (RUN_DIR/tls/nodes/<ip>/<role>, astra.tls_certs.child_credential) as the
child is placed.

Logs: each child's actor keeps its log, and a RaaS's engine server logs, under
`supervision.max_log_bytes` on the child's own node (astra.run.ray_actor); the supervisor,
which reads them over the shared filesystem, never truncates them.

The run directory must be on a filesystem every node shares, at the same path:
children read their configs, the dataset and the model from it, write their
state, checkpoints and logs to it, and the supervisor reads logs, metrics and
checkpoints back. On one machine (a local Ray instance) that holds by itself.
Every node needs the same installation of astra (the same Python path, or the
node's own Python: a command started with the supervisor's interpreter runs
with the actor's).

`--ray auto` connects to the running cluster (RAY_ADDRESS, or the one started on
this machine by `ray start`); when there is none it starts a local instance just
for this run (no dashboard, as many logical CPUs as the recipe has children) and
shuts it down at the end. `--ray HOST:PORT` connects to that cluster's GCS.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from astra.run.children import Child, ChildFailed
from astra.run.ray_actor import process_actor
from astra.run.recipe import Recipe
from astra.tls_certs import child_credential
from astra.tls_material import ENV_DIR, ENV_NODE_CA
from astra.waits import within

log = logging.getLogger("astra.run")
SERVE_ROLES = ("dataflow", "weights", "raas", "trainer")
CORE_ROLES = ("dataflow", "weights")
ACTOR_LOST = -int(signal.SIGKILL)  # a child whose actor (or node) died: as if killed


class RayUnavailable(RuntimeError):
    """No Ray cluster at the address given (or none could be started)."""


def _flag(args: list[str], name: str) -> str | None:
    """The value of `name VALUE` or `name=VALUE` in a command line (the last one)."""
    found = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            found = args[i + 1]
        elif a.startswith(name + "="):
            found = a.partition("=")[2]
    return found


def resources(role: str, args: list[str], trainer_device: str = "cpu") -> dict[str, float]:
    """Ray resources of one child: GPUs when its device is cuda (a trainer: one per rank), else
    one CPU."""
    device = _flag(args, "--device") or (trainer_device if role == "trainer" else "cpu")
    if role in ("raas", "trainer", "warmup") and device.startswith("cuda"):
        return {"num_cpus": 1, "num_gpus": int(_flag(args, "--nproc") or 1)}
    return {"num_cpus": 1, "num_gpus": 0}


def command_on_node(role: str, args: list[str], node_ip: str) -> list[str]:
    """The child's command on its node: a service listens on (and advertises) the node's IP
    (`--host` last: it wins over a config's host)."""
    if role in SERVE_ROLES and "serve" in args[:4] and args[-2:] != ["--host", node_ip]:
        return [*args, "--host", node_ip]
    return list(args)


async def _get(ref: Any) -> Any:
    return await asyncio.wrap_future(ref.future())


class RemoteProcess:
    """What `Child.proc` stands for: the process runs on a Ray node."""

    def __init__(self, child: RayChild, pid: int) -> None:
        self.child, self.pid = child, pid

    @property
    def returncode(self) -> int | None:
        return self.child.returncode


class RayChild(Child):
    """A `Child` whose process a Ray actor starts and watches on the node Ray placed it on."""

    # Its log is written by a process on another node, through the shared filesystem, where
    # truncating under an appending writer is not safe on every filesystem (NFS): its actor
    # rotates it on that node (`rotation`, astra.run.ray_actor), not the supervisor.
    rotatable = False

    def __init__(
        self,
        name: str,
        role: str,
        args: list[str],
        log_path: Path,
        env: dict[str, str],
        *,
        resources: dict[str, float],
        driver_node: str | None = None,
        placement_timeout_s: float = 120.0,
        rotation: tuple[int, int, float] | None = None,
    ) -> None:
        super().__init__(name, role, args, log_path, env)
        self.resources = resources
        # (max_bytes, backups, check interval) for its actor; None: never rotated
        self.rotation = rotation
        self.driver_node = driver_node
        self.placement_timeout_s = placement_timeout_s
        self.placement: dict[str, Any] = {}
        self.proc: Any = None  # RemoteProcess once started
        self._rc: int | None = None
        self._exit: asyncio.Future[int] | None = None
        # Asked for now: the actors of a group (made before the group spawns) start together.
        self.actor: Any = process_actor().options(**self._options()).remote()
        self._placed = self.actor.placement.remote()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def returncode(self) -> int | None:
        return self._rc

    def _options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {**self.resources, "max_concurrency": 16, "max_restarts": 0}
        if self.role in CORE_ROLES and self.driver_node:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                self.driver_node, soft=True
            )
        return opts

    async def spawn(self) -> None:
        import ray

        if self.actor is None:
            raise ChildFailed(f"{self.name}: its Ray actor was released")
        # Again after a death (astra.run.restarts): the same actor starts the new process,
        # after what is left of the group of the one before is SIGKILLed.
        if self.proc is not None:
            await self._signal(signal.SIGKILL)
        self._rc, self.proc, self._exit, self.info, self.stopping = None, None, None, {}, False
        try:
            self.placement = await within(_get(self._placed), self.placement_timeout_s)
        except TimeoutError:
            self.close()
            raise ChildFailed(
                f"{self.name}: no Ray node gave {self.resources} within "
                f"{self.placement_timeout_s:.0f}s (see `ray status`)"
            ) from None
        except ray.exceptions.RayError as exc:
            self.close()
            raise ChildFailed(f"{self.name}: its Ray actor did not start: {exc}") from exc
        self.args = command_on_node(self.role, self.args, self.placement["node_ip"])
        env = {k: v for k, v in os.environ.items() if k.startswith("ASTRA_")}
        node_ca = env.pop(ENV_NODE_CA, "")
        if node_ca:  # `tls: true`: a credential for its role and the address it listens on
            node = child_credential(
                Path(node_ca), self.role, self.placement["node_ip"], self.policies
            )
            env[ENV_DIR] = self.credential = str(node)
        own_python = self.args[0] == sys.executable
        started = await self._call(
            "start",
            self.args,
            {**env, **self.env},
            str(self.log_path),
            os.getcwd(),
            own_python,
            self._rotate(),
        )
        if "error" in started:
            self.close()
            raise ChildFailed(f"{self.name}: {started['error']}")
        self.log_offset = int(started["log_offset"])
        self.log_copies = frozenset(
            (int(dev), int(ino)) for dev, ino in started.get("log_copies", [])
        )
        self.proc = RemoteProcess(self, int(started["pid"]))
        self._exit = asyncio.ensure_future(self._wait_exit())

    async def _wait_exit(self) -> int:
        import ray

        try:
            rc = await _get(self.actor.wait.remote())
        except ray.exceptions.RayError as exc:
            if self._rc is None and not self.stopping:
                log.warning("%s: its Ray actor is gone (%s)", self.name, exc)
            rc = None
        if self._rc is None:
            self._rc = ACTOR_LOST if rc is None else int(rc)
        return self._rc

    def _rotate(self) -> dict[str, Any] | None:
        """What its actor keeps small: the log, and a RaaS's engine server logs."""
        if self.rotation is None:
            return None
        args = self.args
        state = args[args.index("--state-dir") + 1] if "--state-dir" in args[:-1] else ""
        max_bytes, backups, every_s = self.rotation
        return {"max_bytes": max_bytes, "backups": backups, "state_dir": state, "every_s": every_s}

    async def _call(self, method: str, *args: Any) -> Any:
        import ray

        try:
            return await _get(getattr(self.actor, method).remote(*args))
        except ray.exceptions.RayError as exc:
            raise ChildFailed(f"{self.name}: its Ray actor is gone ({exc})") from exc

    async def read_address(self, timeout_s: float) -> dict[str, Any]:
        first = await self._call("first_line", timeout_s)
        if first.get("timeout"):
            raise ChildFailed(f"{self.name}: no address line within {timeout_s:.0f}s")
        if first.get("eof"):
            rc = await self.wait()
            raise ChildFailed(f"{self.name} exited ({rc}) before serving")
        line = first["line"]
        try:
            self.info = json.loads(line)
        except json.JSONDecodeError:
            raise ChildFailed(f"{self.name}: unexpected first line {line[:200]!r}") from None
        return self.info

    async def result(self) -> dict[str, Any]:
        done = await self._call("result")
        rc = self._rc = done["returncode"] if done["returncode"] is not None else ACTOR_LOST
        if rc != 0:
            raise ChildFailed(f"{self.name} exited with {rc}")
        out = str(done["stdout"])
        lines = out.strip().splitlines()
        try:
            self.info = json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError):
            raise ChildFailed(f"{self.name}: no result line on stdout ({out[-200:]!r})") from None
        return self.info

    async def wait(self) -> int:
        assert self._exit is not None
        return await asyncio.shield(self._exit)

    def signal_group(self, sig: int) -> None:
        if self.actor is not None and self.proc is not None:
            with contextlib.suppress(Exception):
                self.actor.signal.remote(int(sig))  # not waited for

    async def _signal(self, sig: int) -> None:
        with contextlib.suppress(ChildFailed):
            await self._call("signal", int(sig))

    async def stop(self, grace_s: float) -> int | None:
        """SIGTERM to the group, wait `grace_s`, then SIGKILL; the actor goes after."""
        if self._exit is None:
            self.close()
            return None
        self.stopping = True
        if self._rc is None:
            await self._signal(signal.SIGTERM)
            try:
                await within(asyncio.shield(self._exit), grace_s)
            except TimeoutError:
                log.warning("%s did not stop within %.0fs: SIGKILL", self.name, grace_s)
        # Leftover members of the group (ranks, helpers) go too, even after the leader exited.
        await self._signal(signal.SIGKILL)
        try:
            rc: int | None = await within(asyncio.shield(self._exit), 30.0)
        except TimeoutError:
            rc = None
        self.close()
        return rc

    def close(self) -> None:
        """Releases the actor (and so the child's resources); a child still running dies too."""
        if self.actor is None:
            return
        import ray

        with contextlib.suppress(Exception):
            ray.kill(self.actor, no_restart=True)
        self.actor = None

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "ray": {**self.placement, "resources": self.resources}}


class RayChildren:
    """The supervisor's child factory under --ray: `(name, role, args, log_path, env)` ->
    RayChild with the resources of its role and device."""

    def __init__(self, recipe: Recipe, driver_node: str | None) -> None:
        self.recipe, self.driver_node = recipe, driver_node

    def __call__(
        self, name: str, role: str, args: list[str], log_path: Path, env: dict[str, str]
    ) -> RayChild:
        s = self.recipe.supervision
        return RayChild(
            name,
            role,
            args,
            log_path,
            env,
            resources=resources(role, args, self.recipe.trainer.device),
            driver_node=self.driver_node,
            placement_timeout_s=s.startup_timeout_s,
            rotation=(s.max_log_bytes, s.log_backups, s.log_check_interval_s)
            if s.max_log_bytes > 0
            else None,
        )


def local_cpus(recipe: Recipe) -> int:
    """Logical CPUs of a local instance: one per child that can run at once (each asks one)."""
    adds = sum(1 for e in recipe.elastic if e.add is not None)
    return max(os.cpu_count() or 1, 2 + len(recipe.raas) + len(recipe.policies) + adds + 1)


def _reachable(address: str, timeout_s: float = 5.0) -> None:
    """OSError when nothing listens at a GCS HOST:PORT (ray.init would retry for minutes)."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if sep and port.isdigit():
        socket.create_connection((host, int(port)), timeout_s).close()


@contextlib.contextmanager
def ray_cluster(address: str, recipe: Recipe) -> Iterator[RayChildren]:
    """Connects to the cluster at `address` ("auto": the running one, else a local instance
    started here and shut down on exit); yields the child factory."""
    import ray

    started = False
    try:
        if address == "auto":
            try:
                ray.init(address="auto", log_to_driver=False)
            except ConnectionError:
                os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
                cpus = local_cpus(recipe)
                ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
                started = True
        else:
            _reachable(address)
            ray.init(address=address, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError, OSError) as exc:
        raise RayUnavailable(f"ray at {address}: {exc}") from exc
    try:
        ctx = ray.get_runtime_context()
        driver = ctx.get_node_id()
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        log.info(
            "ray: %s (%s), %d node(s), resources %s",
            "a local instance started for this run" if started else "connected",
            ctx.gcs_address,
            len(nodes),
            {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")},
        )
        yield RayChildren(recipe, driver)
    finally:
        ray.shutdown()  # a local instance started here stops with it
