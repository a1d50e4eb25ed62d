"""An external RaaS (`raas.N.command`) is told its labels: the {labels} placeholder."""

from __future__ import annotations

from pathlib import Path

import pytest

from astra.run import layout
from astra.run.layout import RunDir
from astra.run.recipe import RecipeError, load_recipe


def test_labels_placeholder_carries_the_entrys_labels_sorted(tmp_path: Path) -> None:
    cmd = "[my-raas, '--labels={labels}', '{{labels}}']"
    r = load_recipe(
        None, [f"raas.0.command={cmd}", "raas.0.labels.zone=eu-1", "raas.0.labels.hw=h200"]
    )
    args = layout.raas_command(r, 0, RunDir(tmp_path / "run"), "h:1")
    assert args == ["my-raas", "--labels=hw=h200,zone=eu-1", "{labels}"]
    pairs = dict(p.split("=", 1) for p in args[1].removeprefix("--labels=").split(","))
    assert pairs == r.raas[0].labels


def test_labels_placeholder_is_empty_without_labels(tmp_path: Path) -> None:
    r = load_recipe(None, ["raas.0.command=[my-raas, 'L={labels}']"])
    assert layout.raas_command(r, 0, RunDir(tmp_path / "run"), "h:1") == ["my-raas", "L="]


@pytest.mark.parametrize("label", ["raas.0.labels.a=x,y", "raas.0.labels.a,b=x"])
def test_labels_the_placeholder_cannot_carry_are_refused(label: str) -> None:
    with pytest.raises(RecipeError, match=r"takes \{labels\}"):
        load_recipe(None, ["raas.0.command=[my-raas, '{labels}']", label])
    # Without {labels} in the command, such labels are fine (they are only routed by).
    load_recipe(None, ["raas.0.command=[my-raas]", label])
