"""Tests for astra.dataflow.dataset: loading, seeded order, durable position, work ids."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from astra.dataflow.config import DatasetSettings
from astra.dataflow.dataset import DatasetError, PromptSource, load_records


def write_jsonl(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"p{i}", "answer": i}) + "\n" for i in range(n)))
    return path


def make_source(path: Path, **kw) -> PromptSource:
    cfg = DatasetSettings(path=str(path), **kw)
    return PromptSource(cfg, ("actor",), "math", 4, "ps")


def drain(src: PromptSource) -> list[str]:
    return [item.group_id for item in src]


def test_load_jsonl_skips_blank_lines(tmp_path: Path) -> None:
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "a"}\n\n   \n{"prompt": "b", "x": [1, 2]}\n')
    assert load_records(p) == [{"prompt": "a"}, {"prompt": "b", "x": [1, 2]}]


def test_load_parquet_plain_values(tmp_path: Path) -> None:
    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "n": [1, 2], "tags": [["x"], []]}), p)
    recs = load_records(p)
    assert recs == [{"prompt": "a", "n": 1, "tags": ["x"]}, {"prompt": "b", "n": 2, "tags": []}]
    assert type(recs[0]["n"]) is int
    src = PromptSource(DatasetSettings(path=str(p)), ("actor",), "math", 2, "ps")
    assert src.size == 2


def test_load_errors_name_file_and_line(tmp_path: Path) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text('{"prompt": "a"}\n\n{"prompt": \n')
    with pytest.raises(DatasetError, match=r"bad\.jsonl:3"):
        load_records(p)
    p.write_text('{"prompt": "a"}\n[1, 2]\n')
    with pytest.raises(DatasetError, match=r"bad\.jsonl:2.*object"):
        load_records(p)
    with pytest.raises(DatasetError, match="not found"):
        load_records(tmp_path / "missing.jsonl")
    p.write_text("\n\n")
    with pytest.raises(DatasetError, match="empty"):
        load_records(p)


def test_missing_prompt_field_names_record(tmp_path: Path) -> None:
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "a"}\n{"prompt": ""}\n')
    with pytest.raises(DatasetError, match="record 1"):
        make_source(p)
    p.write_text('{"question": "a"}\n')
    with pytest.raises(DatasetError, match="record 0"):
        make_source(p)
    assert make_source(p, prompt_field="question").size == 1


def test_same_seed_same_order_different_epochs_differ(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "d.jsonl", 50)
    a = drain(make_source(p, num_epochs=3, seed=7))
    b = drain(make_source(p, num_epochs=3, seed=7))
    assert a == b
    assert a != drain(make_source(p, num_epochs=3, seed=8))
    epochs = [[gid.split("/")[2] for gid in a if gid.split("/")[1] == str(e)] for e in range(3)]
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]


def test_every_record_once_per_epoch(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "d.jsonl", 23)
    src = make_source(p, num_epochs=2)
    items = list(src)
    assert len(items) == 46
    for e in range(2):
        assert sorted(it.index for it in items if it.epoch == e) == list(range(23))
    for it in items:
        assert it.group_id == f"ps/{it.epoch}/{it.index}"
        assert it.record == {"prompt": f"p{it.index}", "answer": it.index}
        assert it.policy_ids == ("actor",) and it.workflow == "math" and it.num_samples == 4


def test_no_shuffle_is_file_order(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "d.jsonl", 5)
    assert [it.index for it in make_source(p, shuffle=False)] == [0, 1, 2, 3, 4]


def test_restore_mid_epoch_continues_exactly(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "d.jsonl", 10)
    full = drain(make_source(p, num_epochs=3, seed=3))
    for cut in (0, 4, 10, 17, 29, 30):
        first = make_source(p, num_epochs=3, seed=3)
        before = [first.next().group_id for _ in range(cut)]  # type: ignore[union-attr]
        saved = json.loads(json.dumps(first.state()))
        second = make_source(p, num_epochs=3, seed=3)
        second.restore(saved)
        assert before + drain(second) == full


def test_restore_refuses_changed_dataset(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "d.jsonl", 10)
    src = make_source(p)
    src.next()
    saved = src.state()
    p.write_text(p.read_text().replace('"p3"', '"p3 edited"'))
    with pytest.raises(DatasetError, match="changed"):
        make_source(p).restore(saved)
    with pytest.raises(DatasetError, match="seed"):
        make_source(write_jsonl(p, 10), seed=1).restore(saved)


def test_num_epochs_bound(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "d.jsonl", 4)
    src = make_source(p, num_epochs=2)
    assert not src.exhausted
    assert len(drain(src)) == 8
    assert src.exhausted and src.next() is None and src.epoch == 2


def test_unbounded_epochs(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "d.jsonl", 3)
    src = make_source(p, num_epochs=0)
    items = [src.next() for _ in range(31)]
    assert all(it is not None for it in items)
    assert not src.exhausted and src.epoch == 10 and src.position == 1


def test_item_for_round_trip_and_rejects_foreign(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "d.jsonl", 6)
    src = make_source(p, num_epochs=2)
    for it in list(src):
        assert src.item_for(it.group_id) == it
    for bad in ("ps/0/6", "ps/2/0", "other/0/1", "ps/0", "ps/x/1", "ps/0/01", "ps/-1/0", "0/1"):
        with pytest.raises(ValueError):
            src.item_for(bad)
    nested = PromptSource(DatasetSettings(path=str(p)), ("a", "b"), "duel", 2, "team/x")
    assert nested.item_for("team/x/0/5").index == 5


def test_a_negative_shuffle_seed_is_refused_in_the_config(tmp_path):
    """numpy refuses a negative seed: accepted, it would fail every dispatch round at the first
    draw while the run looked healthy. The config refuses it up front."""
    from pydantic import ValidationError

    from astra.dataflow.config import DatasetSettings

    path = write_jsonl(tmp_path / "d.jsonl", 3)
    with pytest.raises(ValidationError, match="seed"):
        DatasetSettings(path=str(path), seed=-1)
    cfg = DatasetSettings(path=str(path), seed=0)
    src = make_source(path, seed=cfg.seed)
    assert len(drain(src)) == 3
