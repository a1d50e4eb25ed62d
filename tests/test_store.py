"""The durable store: groups survive reopening, segments are collected, rollbacks leave no rows."""

from __future__ import annotations

import zlib

import pytest

from astra.dataflow.blobs import HEADER, BlobLog, CorruptRecord, check_record
from astra.dataflow.records import GroupRecord, TrajectoryRecord
from astra.dataflow.store import StateStore


def group(gid: str, n: int = 3, size: int = 1000) -> GroupRecord:
    trajs = [
        TrajectoryRecord(f"{gid}/{i}", float(i), 2, 3, size, bytes([i % 256]) * size)
        for i in range(n)
    ]
    return GroupRecord(gid, "policy", 0, trajs, seq=7)


def test_groups_round_trip_across_reopen(tmp_path):
    store = StateStore(tmp_path)
    with store.tx() as tx:
        tx.add_groups([group("a"), group("b")])
        tx.put("k", {"x": 1})
        tx.set_work("a", "s", "done", outcome="accepted")
    store.close()
    again = StateStore(tmp_path)
    loaded = {g.group_id: g for g, batch in again.groups()}
    assert set(loaded) == {"a", "b"}
    assert loaded["a"].trajectories == group("a").trajectories
    assert loaded["a"].seq == 7
    assert again.get("k") == {"x": 1}
    assert again.work_rows()[0].outcome == "accepted"
    again.close()


def test_rollback_writes_no_row(tmp_path):
    store = StateStore(tmp_path)
    with pytest.raises(RuntimeError), store.tx() as tx:
        tx.add_groups([group("a")])
        raise RuntimeError("crash inside the transaction")
    assert store.groups() == []
    store.close()


def test_segments_are_deleted_when_nothing_points_into_them(tmp_path):
    store = StateStore(tmp_path)
    store.blobs.segment_bytes = 4000  # one group per segment
    with store.tx() as tx:
        tx.add_groups([group("a"), group("b"), group("c")])
    files = sorted(p.name for p in (tmp_path / "blobs").glob("*.seg"))
    assert len(files) == 3
    with store.tx() as tx:
        tx.delete_groups([("a", "policy"), ("b", "policy")])
    left = sorted(p.name for p in (tmp_path / "blobs").glob("*.seg"))
    assert left == files[2:]
    store.close()
    reopened = StateStore(tmp_path)
    assert [g.group_id for g, _ in reopened.groups()] == ["c"]
    reopened.close()


def test_blob_log_rejects_a_short_read(tmp_path):
    log = BlobLog(tmp_path)
    seg, off, length = log.append(b"abc")
    assert log.read(seg, off, length) == b"abc"
    with pytest.raises(CorruptRecord, match="short read"):
        log.read(seg, off, length + 5)
    log.close()


def test_blob_records_carry_zlib_crc32_and_a_flipped_byte_is_caught(tmp_path):
    """The record header's CRC is zlib's CRC-32 of the body (whichever implementation wrote
    it), so logs written by earlier builds still read, and damage is found."""
    log = BlobLog(tmp_path / "blobs")
    parts = [b"head", memoryview(bytes(range(256)) * 64), b"tail"]
    body = b"".join(bytes(p) for p in parts)
    seg, off, length = log.append_parts(parts)
    path = tmp_path / "blobs" / f"{seg:08d}.seg"
    raw = path.read_bytes()[off : off + length]
    assert raw[:8] == HEADER.pack(len(body), zlib.crc32(body))
    assert log.read(seg, off, length) == body
    damaged = raw[:100] + bytes([raw[100] ^ 1]) + raw[101:]
    with pytest.raises(CorruptRecord, match="CRC-32"):
        check_record(path, off, damaged, length)
    log.close()


def test_staged_bytes_written_ahead_are_used_or_given_back(tmp_path):
    store = StateStore(tmp_path)
    store.blobs.segment_bytes = 4000  # one group per segment
    a, b = group("a"), group("b")
    staged = {st.key: st for st in (store.stage(a), store.stage(b))}
    StateStore.write_staged(staged.values())  # the writer thread's part
    with store.tx() as tx:
        tx.add_groups([a], staged)  # uses a's staged bytes; b is never stored
    store.discard_staged(staged.values())
    assert staged[("a", "policy")].used and not staged[("b", "policy")].used
    assert len(list((tmp_path / "blobs").glob("*.seg"))) == 2  # b's segment is still active
    c = group("c")
    with store.tx() as tx:  # not staged: written inside the transaction
        tx.add_groups([c], staged)
    assert len(list((tmp_path / "blobs").glob("*.seg"))) == 2  # b's segment dropped
    store.close()
    again = StateStore(tmp_path)
    loaded = {g.group_id: g for g, _ in again.groups()}
    assert set(loaded) == {"a", "c"}
    assert loaded["a"].trajectories == a.trajectories
    again.close()


def test_staged_bytes_of_a_rolled_back_transaction_are_given_back(tmp_path):
    store = StateStore(tmp_path)
    a = group("a")
    staged = {("a", "policy"): store.stage(a)}
    StateStore.write_staged(staged.values())
    with pytest.raises(RuntimeError), store.tx() as tx:
        tx.add_groups([a], staged)
        raise RuntimeError("crash inside the transaction")
    store.discard_staged(staged.values())
    assert not staged[("a", "policy")].used
    assert store.blobs.live[store.blobs.active] == 0
    assert store.groups() == []
    store.close()


def test_staged_room_is_counted_once_per_reservation(tmp_path):
    """Every reservation is either used by a row or given back: none leaks."""
    store = StateStore(tmp_path)
    a = group("a")
    staged = {("a", "policy"): store.stage(a)}
    StateStore.write_staged(staged.values())
    assert store.blobs.live[store.blobs.active] == 1
    store.discard_staged(staged.values())
    assert store.blobs.live[store.blobs.active] == 0
    store.close()


class _FullDiskAtCommit:
    """The store's connection, whose next COMMIT fails as on a full disk."""

    def __init__(self, conn) -> None:
        self.conn, self.fail = conn, True

    def execute(self, sql, *args):
        if sql == "COMMIT" and self.fail:
            self.fail = False
            import sqlite3

            raise sqlite3.OperationalError("database or disk is full")
        return self.conn.execute(sql, *args)

    def __getattr__(self, name):
        return getattr(self.conn, name)


def test_a_failed_commit_is_rolled_back_reported_and_the_store_goes_on(tmp_path):
    import sqlite3

    store = StateStore(tmp_path)
    failures = []
    store.on_failure = failures.append
    real = store.conn
    store.conn = _FullDiskAtCommit(real)
    with pytest.raises(sqlite3.OperationalError), store.tx() as tx:
        tx.add_groups([group("g1")])
    assert len(failures) == 1 and "full" in str(failures[0])
    store.conn = real
    with store.tx() as tx:  # no transaction was left open
        tx.add_groups([group("g2")])
    assert [g.group_id for g, _ in store.groups()] == ["g2"], "g1 was rolled back"
    with pytest.raises(ValueError), store.tx():  # not a storage failure: not reported
        raise ValueError("a refusal")
    assert len(failures) == 1
    store.close()


def test_done_groups_keep_the_newest_in_memory_and_ask_the_table_for_the_rest() -> None:
    from astra.dataflow.done import DoneGroups

    table = {"s/0/0", "s/0/1"}  # done before this process started
    asked: list[str] = []

    def is_done(gid: str) -> bool:
        asked.append(gid)
        return gid in table

    done = DoneGroups(is_done, len(table), recent=2)
    assert "s/0/0" in done and asked == ["s/0/0"] and len(done) == 2
    for gid in ("s/0/2", "s/0/3", "s/0/4"):
        table.add(gid)  # the caller's transaction records it
        done.add(gid)
    assert len(done) == 5 and done.in_memory == 2
    asked.clear()
    assert "s/0/4" in done and "s/0/3" in done and asked == []  # the newest: from memory
    assert "s/0/2" in done and asked == ["s/0/2"]  # forgotten: from the table
    assert "s/0/9" not in done and 7 not in done
