"""Configs: unknown keys fail, env overrides apply, every shipped config parses."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from astra.config import ConfigError, load_config
from astra.dataflow.config import DataflowConfig
from astra.dataflow.versions import VersionBook

ROOT = Path(__file__).resolve().parent.parent


def write(tmp_path: Path, data: dict) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


BASE = {
    "policies": [{"id": "p"}],
    "streams": [{"name": "s", "dataset": {"path": "x.jsonl"}, "policy_ids": ["p"]}],
}


def test_unknown_key_is_an_error_naming_it(tmp_path):
    bad = {**BASE, "pool": {"heartbeat_intervall_s": 1}}
    with pytest.raises(ConfigError, match=r"pool\.heartbeat_intervall_s"):
        load_config(DataflowConfig, write(tmp_path, bad), env_prefix="ASTRA_DATAFLOW", environ={})


def test_unknown_env_key_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="bogus"):
        load_config(
            DataflowConfig,
            write(tmp_path, BASE),
            env_prefix="ASTRA_DATAFLOW",
            environ={"ASTRA_DATAFLOW__BOGUS": "1"},
        )


def test_precedence_file_then_env_then_flags(tmp_path):
    data = {**BASE, "port": 1000, "pool": {"confirm_failures": 2}}
    cfg = load_config(
        DataflowConfig,
        write(tmp_path, data),
        env_prefix="ASTRA_DATAFLOW",
        environ={"ASTRA_DATAFLOW__PORT": "2000", "ASTRA_DATAFLOW__POOL__CONFIRM_FAILURES": "7"},
        overrides={"port": 3000, "host": None},
    )
    assert cfg.port == 3000 and cfg.pool.confirm_failures == 7
    assert cfg.pool.heartbeat_interval_s == 2.0


def test_bounds_and_references_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="group_size"):
        load_config(
            DataflowConfig,
            write(tmp_path, {**BASE, "streams": [{**BASE["streams"][0], "group_size": 0}]}),
            env_prefix="X",
            environ={},
        )
    with pytest.raises(ConfigError, match="unknown policies"):
        load_config(
            DataflowConfig,
            write(tmp_path, {**BASE, "streams": [{**BASE["streams"][0], "policy_ids": ["q"]}]}),
            env_prefix="X",
            environ={},
        )


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("dataflow*.yaml")), ids=str)
def test_every_shipped_dataflow_config_parses(path):
    cfg = load_config(DataflowConfig, path, env_prefix="X", environ={})
    for stream in cfg.streams:
        assert (ROOT / stream.dataset.path).exists()


def test_lockstep_barrier_moves_policies_together():
    book = VersionBook(["a", "b"], "lockstep")
    book.announce("a", 0, "", "w:1")
    book.announce("b", 0, "", "w:1")
    assert {p: t.version for p, t in book.targets().items()} == {"a": 0, "b": 0}
    book.announce("a", 1, "", "w:1")
    book.announce("a", 2, "", "w:1")
    assert {p: t.version for p, t in book.targets().items()} == {"a": 0, "b": 0}
    book.announce("b", 1, "", "w:1")
    assert {p: t.version for p, t in book.targets().items()} == {"a": 1, "b": 1}
    independent = VersionBook(["a", "b"], "independent")
    independent.announce("a", 1, "", "w:1")
    assert {p: t.version for p, t in independent.targets().items()} == {"a": 1}
