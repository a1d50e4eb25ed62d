"""`astra run [RECIPE] [--run-dir DIR] [--set KEY=VALUE ...] [--resume DIR]`.

RECIPE: a YAML file, or the name of one in configs/recipes (`astra run smoke`).
Without RECIPE: the embedded default (astra.run.recipe.Recipe()). The run
directory defaults to runs/<recipe name>-<UTC time>; --resume DIR reads
DIR/recipe.yaml back (overrides still apply), keeps Dataflow's state, the
weight store and the RaaS directories, and restarts each trainer from its newest
checkpoint for the steps it has left. --ray auto|ADDRESS places the same processes
on a Ray cluster (astra.run.ray_children; `pip install 'astra-rl[ray]'`). Exit
status: 0 when every trainer finished, 1 when a child failed, 128 + signal number
when stopped by a signal.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import click

from astra.durable import make_dirs

if TYPE_CHECKING:
    from astra.run.sections import SupervisionSpec


@click.command("run")
@click.argument("recipe", required=False)
@click.option("--run-dir", type=click.Path(file_okay=False), help="Where logs and outputs go.")
@click.option(
    "--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Dotted override (repeatable)."
)
@click.option(
    "--resume",
    "resume_dir",
    type=click.Path(file_okay=False, exists=True),
    help="Continue the run in this directory.",
)
@click.option(
    "--ray",
    "ray_address",
    metavar="auto|ADDRESS",
    help="Place the children on a Ray cluster (auto: the running one, else a local one).",
)
@click.option("--print-recipe", is_flag=True, help="Print the resolved recipe and exit.")
@click.option("--log-level", default="info", show_default=True)
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    default=None,
    help="Every process's log format (default: $ASTRA_LOG_FORMAT, else text).",
)
def run_command(
    recipe: str | None,
    run_dir: str | None,
    overrides: tuple[str, ...],
    resume_dir: str | None,
    ray_address: str | None,
    print_recipe: bool,
    log_level: str,
    log_format: str | None,
) -> None:
    """Run the whole system (Dataflow, WeightService, RaaS, trainers) from one recipe."""
    from astra.run.layout import RunDir
    from astra.run.recipe import RecipeError, dump_recipe, load_recipe

    if resume_dir is not None:
        if recipe is not None:
            raise click.UsageError("--resume reads DIR/recipe.yaml: give no RECIPE")
        if run_dir is not None and Path(run_dir).resolve() != Path(resume_dir).resolve():
            raise click.UsageError("--resume DIR is the run directory: no --run-dir")
        recipe = str(Path(resume_dir) / "recipe.yaml")
        if not Path(recipe).is_file():
            raise click.UsageError(f"{recipe}: not found (not a run directory?)")
        run_dir = resume_dir
    elif recipe is not None:
        from astra.run.recipe import RecipeError as NotFound
        from astra.run.recipe import find_recipe

        try:
            recipe = str(find_recipe(recipe))
        except NotFound as exc:
            _exit_2(str(exc))
    try:
        resolved = load_recipe(recipe, overrides)
    except RecipeError as exc:
        raise click.UsageError(str(exc)) from exc
    if print_recipe:
        click.echo(dump_recipe(resolved), nl=False)
        return
    from astra.run.preflight import PreflightError, check

    try:
        check(resolved)
    except PreflightError as exc:  # before a run directory exists: nothing left behind
        _exit_2(str(exc))
    if run_dir is None:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        run_dir = str(Path("runs") / f"{resolved.name}-{stamp}")
    rd = RunDir(Path(run_dir))
    if resume_dir is None and rd.recipe.exists():
        raise click.UsageError(f"{rd.root} holds a run: use --resume DIR or another --run-dir")
    try:
        make_dirs(rd.root)
        if not os.access(rd.root, os.W_OK | os.X_OK):
            raise PermissionError(13, "not writable")
    except OSError as exc:
        _exit_2(
            f"--run-dir {rd.root}: cannot write there ({exc.strerror or exc}); give a "
            "directory you can write, or leave --run-dir out (runs/<name>-<time>)"
        )
    from astra.run import ownership

    try:
        held = ownership.hold(rd)  # for this process's life: one supervisor per run
    except ownership.RunBusy as exc:
        _exit_2(str(exc))
    if log_format is not None:  # children inherit the environment
        os.environ["ASTRA_LOG_FORMAT"] = log_format
    _tls(resolved.tls, rd.root)
    _logging(log_level, rd.log("supervisor"), resolved.supervision)
    if resume_dir is not None:
        try:
            ownership.before_resume(rd, resolved.supervision.stop_grace_s)
        except ownership.RunBusy as exc:
            held.release()
            _exit_2(str(exc))
    from astra.run.supervisor import Supervisor

    resume = resume_dir is not None
    if ray_address is None:
        code = asyncio.run(Supervisor(resolved, rd, resume=resume).run())
        sys.exit(code)
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise click.UsageError("--ray needs ray: pip install 'astra-rl[ray]'")
    from astra.run.ray_children import RayUnavailable, ray_cluster

    try:
        with ray_cluster(ray_address, resolved) as children:
            code = asyncio.run(
                Supervisor(resolved, rd, resume=resume, child_factory=children).run()
            )
    except RayUnavailable as exc:
        raise click.ClickException(str(exc)) from exc
    sys.exit(code)


def _exit_2(message: str) -> NoReturn:
    click.echo(f"Error: {message}", err=True)
    sys.exit(2)


def _tls(wanted: bool, root: Path) -> None:
    """Mutual TLS for the run's children: the credentials `astra --tls DIR` (or ASTRA_TLS_*)
    gave, which they inherit, else with `tls: true` a CA and a loopback credential of the
    run's own (the supervisor's), made once in RUN_DIR/tls, and a credential per child role
    (per node and role with --ray) issued from it as children start (astra.run.children)."""
    from astra.tls import current_tls
    from astra.tls_certs import DEFAULT_HOSTS, expiring, init_ca, issue
    from astra.tls_material import ENV_DIR, ENV_NODE_CA

    if current_tls() is not None or not wanted:
        return
    directory = root / "tls"
    # Made once; on a resume, made again when about to end (a run of its own CA restarts every
    # process on a resume, so nothing still holds the old ones).
    if (directory / "ca.key").is_file() and expiring(directory / "ca.pem"):
        logging.getLogger("astra.run").warning(
            "the run's CA in %s ends within 30 days: a new CA and credentials", directory
        )
        for name in ("ca.key", "ca.pem", "cert.pem", "key.pem"):
            (directory / name).unlink(missing_ok=True)
        shutil.rmtree(directory / "nodes", ignore_errors=True)
    if not (directory / "ca.key").is_file():
        init_ca(directory, name=f"astra run CA ({root.name})")
    if expiring(directory / "cert.pem"):
        issue(directory, directory, list(DEFAULT_HOSTS))
    os.environ[ENV_DIR] = str(directory.resolve())
    # Each child gets a credential naming its role (on its node's address with --ray), issued
    # by the supervisor from this CA into RUN_DIR/tls/nodes/ (astra.run.children).
    os.environ[ENV_NODE_CA] = str(directory.resolve())


def _logging(level: str, path: Path, supervision: SupervisionSpec) -> None:
    """The supervisor's log: stderr, and `path`, rolled over past supervision.max_log_bytes
    (keeping at least one copy: the supervisor owns its file, so nothing is lost)."""
    from logging.handlers import RotatingFileHandler

    from astra.logs import dump_stacks_on, formatter

    path.parent.mkdir(parents=True, exist_ok=True)
    fmt = formatter()
    root = logging.getLogger()
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    to_file = RotatingFileHandler(
        path, maxBytes=supervision.max_log_bytes, backupCount=max(1, supervision.log_backups)
    )
    for handler in (logging.StreamHandler(sys.stderr), to_file):
        handler.setFormatter(fmt)
        root.addHandler(handler)
    dump_stacks_on(sys.stderr)  # kill -USR1: its threads' stacks, as every child's (astra.logs)


if __name__ == "__main__":
    run_command()
