"""The power goes under a running `astra run`, and `--resume` finishes on what survived.

The whole run directory (Dataflow's state, the WeightService's store, checkpoints, run.json)
lives on the power-cut filesystem (astra.testing.powercut: only what was fsynced survives a
cut, names only once their directory was fsynced). At a seeded random moment of RL every
process of the run is SIGKILLed, the power is cut, and `astra run --resume` runs on what is
left (tools/chaos/campaign.py's `power-cut-then-resume`, which also checks, in Dataflow's
database, that every group a trainer had acknowledged before the cut still is). Then either
the run completed with nothing lost or trained twice (the campaign's audit, in Dataflow's
own records), or it stopped at start-up with one line naming the damaged file and no
traceback. Skipped where /dev/fuse cannot be opened or mount(2) is refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from astra.damage import EXIT_DAMAGED
from astra.dataflow.blobs import BlobLog, CorruptRecord
from astra.testing.powercut import PowerCutMount, PowerCutUnavailable
from astra.testing.powercut.control import unavailable_reason
from astra.weights.store import Store, StoreConfig
from tests.test_chaos import _campaign
from tests.test_weights_store import bf16_model


def _mount(tmp_path: Path) -> PowerCutMount:
    if reason := unavailable_reason():
        pytest.skip(reason)
    try:
        return PowerCutMount(tmp_path / "mnt")
    except PowerCutUnavailable as e:
        pytest.skip(f"mount(2) of fuse is not permitted here: {e}")


def test_a_published_weight_version_survives_a_cut(tmp_path: Path) -> None:
    """A version the store returned from publish is there after the power goes (its
    directories, down from the store's root, were named durably)."""
    with _mount(tmp_path) as fs:
        store = Store(fs.path / "state" / "weights", StoreConfig())
        store.publish("p", "v0", 0, bf16_model(0), files={"config.json": b"{}"})
        fs.cut()
        again = Store(fs.path / "state" / "weights", StoreConfig())
        assert again.get("p", "v0").version == 0


def test_a_blob_segment_keeps_its_number_after_a_cut(tmp_path: Path) -> None:
    """The blob log's bytes are never fsynced, but a segment's name is: after a cut the next
    start numbers its new segment past it, never reusing the number rows point into."""
    with _mount(tmp_path) as fs:
        log = BlobLog(fs.path / "state" / "blobs")
        segment, offset, length = log.append(b"a rollout" * 100)
        log.close()
        fs.cut()
        again = BlobLog(fs.path / "state" / "blobs")
        try:
            assert again.active == segment + 1
            with pytest.raises(CorruptRecord, match="short read"):
                again.read(segment, offset, length)
        finally:
            again.close()


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_power_cut_mid_run_then_resume(tmp_path: Path, seed: int) -> None:
    if reason := unavailable_reason():
        pytest.skip(reason)
    campaign = _campaign()
    run = campaign.Run(tmp_path / "run", steps=12)
    try:
        campaign.power_cut_then_resume(run, seed)
    except PowerCutUnavailable as e:
        pytest.skip(f"mount(2) of fuse is not permitted here: {e}")
    print(f"{'; '.join(run.notes)}; exit codes {run.codes}")
    out = (tmp_path / "run.out").read_text(errors="replace")
    assert "Traceback" not in out, out[-4000:]
    if run.codes == [EXIT_DAMAGED]:  # stopped at start-up: one line names the damaged file
        last = [line for line in out.splitlines() if line.strip()][-1]
        assert str(tmp_path / "run.mnt" / "run") in last, out[-4000:]
        return
    assert campaign.audit(run) == [], out[-4000:]
