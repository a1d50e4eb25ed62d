"""`astra weights publish|fetch|list|rollback --server HOST:PORT`: the WeightService commands.

Registered on the `weights` group by astra/weights/cli.py. Same conventions:
JSON on stdout, logs on stderr, exit 0 success, 1 operational failure
(unreachable service, checksum mismatch, refused content), 2 bad arguments
(including a request the service refuses as INVALID_ARGUMENT). gRPC and
numpy are imported inside the commands, so `--help` stays fast.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import click

from astra.weights.cli_common import DIR, emit, identity_option, run_command

_SERVER = click.option("--server", required=True, help="HOST:PORT of the WeightService.")
_POLICY = click.option("--policy", required=True, help="Policy id.")


def _info(message: Any) -> dict[str, Any]:
    from google.protobuf import json_format

    return json_format.MessageToDict(message, preserving_proto_field_name=True)


@click.command("publish")
@_SERVER
@_POLICY
@click.option(
    "--identity", required=True, callback=identity_option, help="Identity of the version."
)
@click.option("--version", "step", type=click.IntRange(min=0), required=True, help="Step counter.")
@click.argument("directory", type=DIR)
def publish_command(server: str, policy: str, identity: str, step: int, directory: Path) -> None:
    """Publish a full checkpoint DIRECTORY as a new version (resumes an interrupted publish)."""
    from astra.clients.weights_stream import publish_version
    from astra.weights.layout import extra_files, open_full

    def run() -> dict[str, Any]:
        with open_full(directory) as source:
            tensors = {
                n: (e.info.dtype, e.info.shape, source.view(n)) for n, e in source.entries.items()
            }
            files = {p.name: p.read_bytes() for p in extra_files(source)}
            result = asyncio.run(publish_version(server, policy, identity, step, tensors, files))
            tensors.clear()
        return {
            "version": _info(result.version),
            "already_existed": result.already_existed,
            "tensors_sent": result.tensors_sent,
            "tensors_skipped": result.tensors_skipped,
            "attempts": result.attempts,
        }

    emit(run_command(run))


@click.command("fetch")
@_SERVER
@_POLICY
@click.option("--identity", callback=identity_option, help="Version to fetch (default: current).")
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="Receiver directory: versions/, a `current` link, resumable staging.",
)
@click.option("--held", "held_dir", type=DIR, help="A full version to use as the delta base.")
@click.option("--max-bytes-per-second", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--no-fsync", is_flag=True, help="Skip fsync (tests, scratch directories).")
def fetch_command(
    server: str,
    policy: str,
    identity: str | None,
    out_dir: Path,
    held_dir: Path | None,
    max_bytes_per_second: int,
    no_fsync: bool,
) -> None:
    """Fetch a version into --out, verified, and make it current there."""
    from astra.clients.weights_stream import Receiver

    async def fetch() -> dict[str, Any]:
        async with Receiver(
            server,
            policy,
            out_dir,
            held_dirs=[held_dir] if held_dir else [],
            max_bytes_per_second=max_bytes_per_second,
            durable=not no_fsync,
        ) as receiver:
            result = await receiver.fetch(identity or "")
        body = dict(vars(result))
        body["path"] = str(result.path)
        body["current"] = str(out_dir / "current")
        return body

    emit(run_command(lambda: asyncio.run(fetch())))


@click.command("list")
@_SERVER
@_POLICY
def list_command(server: str, policy: str) -> None:
    """List a policy's versions, newest first."""
    from astra.clients.weights import WeightClient, domain_error

    async def collect() -> dict[str, Any]:
        import grpc

        versions, token = [], ""
        async with WeightClient(server) as client:
            try:
                while True:
                    page = await client.list_versions(policy, page_size=1000, page_token=token)
                    versions += [_info(v) for v in page.versions]
                    token = page.next_page_token
                    if not token:
                        return {"versions": versions}
            except grpc.aio.AioRpcError as exc:
                raise domain_error(exc) from exc

    emit(run_command(lambda: asyncio.run(collect())))


@click.command("rollback")
@_SERVER
@_POLICY
@click.option(
    "--to", "source", required=True, callback=identity_option, help="Identity to restore."
)
@click.option(
    "--identity", required=True, callback=identity_option, help="Identity of the new version."
)
@click.option(
    "--version", "step", type=click.IntRange(min=0), help="Step counter (default: current + 1)."
)
@click.option("--request-id", help="Idempotency key (default: derived from --to and --identity).")
def rollback_command(
    server: str, policy: str, source: str, identity: str, step: int | None, request_id: str | None
) -> None:
    """Make --to current again, published as the new identity --identity."""
    from astra.clients.weights import WeightClient, domain_error
    from astra.weights.v1 import weight_service_pb2 as pb

    async def rollback() -> dict[str, Any]:
        import grpc

        async with WeightClient(server) as client:
            try:
                new_step = step
                if new_step is None:
                    page = await client.list_versions(policy, page_size=1)
                    new_step = (page.versions[0].version + 1) if page.versions else 0
                request = pb.RollbackVersionRequest(
                    policy_id=policy,
                    source_version_id=source,
                    new_version_id=identity,
                    new_version=new_step,
                    request_id=(request_id or f"rollback:{source}:{identity}")[:128],
                )
                resp = await client.rollback_version(request)
            except grpc.aio.AioRpcError as exc:
                raise domain_error(exc) from exc
        return {"version": _info(resp.version)}

    emit(run_command(lambda: asyncio.run(rollback())))


COMMANDS = [publish_command, fetch_command, list_command, rollback_command]
