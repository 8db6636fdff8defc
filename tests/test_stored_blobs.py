"""Every stored KV blob proves itself (issue 26, item 1): the faults that made a cut-short, planted or damaged
entry come back as a hit, each kept as a test, against a real Redis and a real cold folder.

The target: 0 corrupt, truncated or foreign blobs handed to an engine. :class:`BigKvEngine` is the sim with
payloads of a real engine's size (4 MiB) that records every payload it is handed, so each test counts the
wrong ones it got.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import logging
import os
import resource
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from registry_values import metric
from redis_fixtures import RedisDb, redis_db, redis_server, start_redis  # noqa: F401

from switchyard.common.priority import PriorityClass
from switchyard.common.config import SwitchyardConfig
from switchyard.common.dram import DramClient
from switchyard.dispatcher.engines.sim import SimEngine, SimKV
from switchyard.dispatcher.request import Request, RequestStatus
from switchyard.dispatcher.tiers import ColdStore, KvStore, MemoryTiers
from switchyard.dispatcher.tiers import blob as blob_mod
from switchyard.dispatcher.tiers.blob import BlobError, open_blob, seal
from switchyard.dispatcher.tiers.dram import Entry

pytestmark = pytest.mark.no_gpu
ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
PREFIX = "switchyard:"


def corrupt(tier: str, reason: str) -> float:
    return metric("switchyard_tier_corrupt_blobs_total", tier=tier, reason=reason)


def payload_for(request_id: str, size: int = 4 * MIB) -> bytes:
    """``size`` bytes that only ``request_id``'s KV state has (NULs included, like real tensors)."""
    block = hashlib.blake2b(request_id.encode(), digest_size=64).digest() + bytes(64)
    return (block * (size // len(block) + 1))[:size]


class BigKV(SimKV):
    """The sim's KV with 4 MiB payloads; ``handed`` records each (request id, payload) given to ``load``."""

    def __init__(self, engine: SimEngine) -> None:
        super().__init__(engine)
        self.handed: list[tuple[str, bytes]] = []

    def export(self, req: Request) -> bytes | None:
        return payload_for(req.request_id)

    def load(self, req: Request, payload: bytes, tokens: int) -> int:
        self.handed.append((req.request_id, payload))
        return max(0, min(tokens, req.num_tokens - 1))


class BigKvEngine(SimEngine):
    """The sim engine with :class:`BigKV` as its KV manager."""

    def __init__(self) -> None:
        super().__init__(SwitchyardConfig())
        self.kv: BigKV = BigKV(self)

    @property
    def handed(self) -> list[tuple[str, bytes]]:
        return self.kv.handed

    def wrong_payloads(self) -> int:
        """Payloads handed to the engine that are not the state its request exported: the target is 0."""
        return sum(payload != payload_for(rid) for rid, payload in self.handed)


def kv_store(db: RedisDb, **dram: Any) -> KvStore:
    config = db.dram_config.model_copy(update=dram)
    return KvStore(DramClient(config), 7200)


def tiers_for(engine: BigKvEngine, store: KvStore | None, cold: ColdStore | None) -> MemoryTiers:
    config = SwitchyardConfig()
    return MemoryTiers(config.memory, config.scheduler.priority_boost, engine.kv, store, cold)


def running_request(rid: str, key: str, tokens: int = 1000) -> Request:
    req = Request(request_id=rid, prompt="How does the with statement work?", priority=PriorityClass.BATCH,
                  task_type="chat", prompt_tokens=tokens + 1, max_tokens=12, arrival=0.0)
    req.status, req.swap_key, req.swap_tokens = RequestStatus.RUNNING, key, tokens
    return req


def entry(key: str, rid: str, stored_at: float = 0.0) -> Entry:
    return Entry(key=key, tokens=1000, nbytes=1000 * 524_288, priority="batch", hits=0, cost_us=30_000.0,
                 stored_at=stored_at, payload=payload_for(rid))


# --------------------------------------------------------------------------- the sealed form


def test_a_sealed_blob_opens_only_whole_under_its_own_key() -> None:
    data = seal(PREFIX + "kv:seq:a", {"tokens": 7}, payload_for("a", MIB))
    opened = open_blob(PREFIX + "kv:seq:a", data)
    assert opened.meta == {"tokens": 7} and opened.payload == payload_for("a", MIB)
    damaged = bytearray(data)
    damaged[len(data) // 2] ^= 0x01
    cases = {
        "header": payload_for("foreign", MIB),  # another program's value
        "key": data,  # opened under another key below
        "length": data[: len(data) // 2],  # cut short half-way
        "checksum": bytes(damaged),  # one bit flipped
    }
    for reason, raw in cases.items():
        with pytest.raises(BlobError) as err:
            open_blob(PREFIX + ("kv:seq:b" if reason == "key" else "kv:seq:a"), raw)
        assert err.value.reason == reason
    with pytest.raises(BlobError) as err:
        open_blob(PREFIX + "kv:seq:a", data + b"\0")  # padded
    assert err.value.reason == "length"
    assert {r for r in blob_mod.REASONS} == set(cases)


# --------------------------------------------------------------------------- DRAM: planted and damaged entries


async def test_foreign_cut_short_and_damaged_dram_entries_are_misses_never_handed_to_the_engine(
        redis_db: RedisDb, caplog: pytest.LogCaptureFixture) -> None:
    client = redis_db.client()
    engine = BigKvEngine()
    store = kv_store(redis_db)
    tiers = tiers_for(engine, store, None)
    good = store.key("seq", "good")
    await store.put(good, payload_for("good"), tokens=1000, nbytes=1000, priority="batch", hits=0, cost_us=1.0)
    sealed = await client.hget(good, "payload")
    flipped = store.key("seq", "flipped")
    await store.put(flipped, payload_for("flipped"), tokens=1000, nbytes=1000, priority="batch", hits=0, cost_us=1.0)
    damaged = bytearray(await client.hget(flipped, "payload"))
    damaged[len(damaged) // 2] ^= 0xFF  # one byte of its own payload, in Redis
    planted = {  # request id -> (payload field, the reason it must be refused for)
        "foreign-1": (payload_for("foreign-1"), "header"),
        "foreign-2": (b"\x00" * 1000, "header"),
        "copied": (sealed, "key"),  # a whole, valid entry, but written under another key
        "half": (sealed[: len(sealed) // 2], "length"),
        "flipped": (bytes(damaged), "checksum"),
    }
    for rid, (raw, _) in planted.items():
        await client.hset(store.key("seq", rid), mapping={"payload": raw, "tokens": 1000, "nbytes": 1000})
    before = {reason: corrupt("dram", reason) for reason in blob_mod.REASONS}
    misses = metric("switchyard_tier_misses_total", tier="dram")
    with caplog.at_level(logging.DEBUG, logger="switchyard.dispatcher.tiers"):
        for rid in planted:
            req = running_request(rid, store.key("seq", rid))
            assert await tiers.restore(req) == 0 and req.recomputed_tokens == 1000
            assert not await client.exists(store.key("seq", rid)), "a refused entry is deleted"
    print(f"\nDRAM: {len(planted)} planted, cut-short or damaged entries, {len(engine.handed)} handed to the engine")
    assert engine.handed == [] and engine.wrong_payloads() == 0
    assert metric("switchyard_tier_misses_total", tier="dram") == misses + len(planted)
    assert {r: corrupt("dram", r) - before[r] for r in blob_mod.REASONS} == {
        "header": 2, "key": 1, "length": 1, "checksum": 1}
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "refused" in r.getMessage()]
    assert len(warnings) <= 4, "logged once per reason"  # fewer when an earlier test logged a reason first
    for record in caplog.records:
        text = record.getMessage()
        assert "\\x00" not in text and "\x00" not in text and len(text) < 600, "no payload bytes in a log line"
    # the real entry still comes back whole
    req = running_request("good", good)
    assert await tiers.restore(req) == 1000
    assert engine.wrong_payloads() == 0 and [rid for rid, _ in engine.handed] == ["good"]
    await tiers.aclose()
    await client.aclose()


# --------------------------------------------------------------------------- cold: writes cut short


def _fail_writes_after(monkeypatch: pytest.MonkeyPatch, limit: int, fault: BaseException) -> None:
    """os.write raises ``fault`` once ``limit`` bytes went out (the edge: the OS): ENOSPC is a disk that fills
    half-way; any other exception stands for a serializer or a library raising half-way through the blob."""
    real = os.write
    sent = 0

    def write(fd: int, data: Any) -> int:
        nonlocal sent
        if sent >= limit:
            raise fault
        n = real(fd, data)
        sent += n
        return n

    monkeypatch.setattr(os, "write", write)


def _cold_files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


@pytest.mark.parametrize("fault", [OSError(errno.ENOSPC, "No space left on device"),
                                   RuntimeError("serializer failed")], ids=["disk-full", "serializer-raised"])
async def test_an_archive_that_fails_half_way_leaves_no_file_and_the_dram_copy_stays(
        redis_db: RedisDb, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: BaseException) -> None:
    client = redis_db.client()
    engine = BigKvEngine()
    store = kv_store(redis_db)
    cold = ColdStore(str(tmp_path / "cold"), PREFIX)
    tiers = tiers_for(engine, store, cold)
    key, other = store.key("seq", "stale"), store.key("seq", "stale-2")
    for k, rid in ((key, "stale"), (other, "stale-2")):
        await store.put(k, payload_for(rid), tokens=1000, nbytes=1000 * 524_288, priority="batch", hits=0,
                        cost_us=30_000.0)
    now = float(await client.hget(key, "stored_at")) + 3 * 3600  # three hours idle: worth archiving
    errors = metric("switchyard_cold_tier_errors_total", operation="put")
    with monkeypatch.context() as patch:
        _fail_writes_after(patch, 2 * MIB, fault)  # half of the first 4 MiB blob
        assert await tiers.scan_dram(now) == (0, 0)
    assert metric("switchyard_cold_tier_errors_total", operation="put") == errors + 1, "one try per scan"
    assert _cold_files(tmp_path / "cold") == [], "nothing under the final name, no temporary name left"
    assert await client.exists(key) and await client.exists(other), "the DRAM copies are the only copies: they stay"
    # the next scan, with room on the disk, archives them whole; then one comes back whole from the cold tier
    assert await tiers.scan_dram(now) == (0, 2)
    assert _cold_files(tmp_path / "cold") == ["seq/stale-2.kv", "seq/stale.kv"] and not await client.exists(key)
    req = running_request("stale", key)
    assert await tiers.restore(req) == 1000
    assert engine.wrong_payloads() == 0 and len(engine.handed) == 1
    await tiers.aclose()
    await client.aclose()


ARCHIVER = textwrap.dedent("""
    import asyncio, hashlib, json, os, sys, time
    from switchyard.dispatcher.tiers import ColdStore
    from switchyard.dispatcher.tiers.dram import Entry

    folder, mode = sys.argv[1], sys.argv[2]
    if mode == "stop-half-way":  # the process stops at half of the blob until the test kills it
        real, sent = os.write, [0]
        def write(fd, data):
            if sent[0] >= 2 << 20:
                print("half", flush=True)
                time.sleep(600)
            n = real(fd, data)
            sent[0] += n
            return n
        os.write = write
    if mode == "killed-by-sigxfsz":  # CPython ignores SIGXFSZ; a process that does not is ended by it
        import signal
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    block = hashlib.blake2b(b"archived", digest_size=64).digest() + bytes(64)
    payload = (block * ((4 << 20) // 128 + 1))[: 4 << 20]
    cold = ColdStore(folder)
    ok = asyncio.run(cold.put(Entry(key="switchyard:kv:seq:archived", tokens=1000, nbytes=1000, priority="batch",
                                    hits=0, cost_us=1.0, stored_at=0.0, payload=payload)))
    print(json.dumps({"ok": ok}), flush=True)
""")


def _archiver(folder: Path, mode: str, preexec: Any = None) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "services")}
    return subprocess.Popen([sys.executable, "-c", ARCHIVER, str(folder), mode], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, preexec_fn=preexec)


async def _assert_cold_miss(folder: Path) -> None:
    """A dispatcher starting on ``folder`` removes partial writes and finds no entry to hand an engine."""
    engine = BigKvEngine()
    cold = ColdStore(str(folder), PREFIX)  # start-up: removes the temporary names of dead writers
    assert _cold_files(folder) == []
    assert await cold.take(PREFIX + "kv:seq:archived") is None
    assert engine.wrong_payloads() == 0


async def test_an_archiver_killed_mid_write_leaves_only_a_temporary_name_removed_at_start(tmp_path: Path) -> None:
    folder = tmp_path / "cold"
    proc = _archiver(folder, "stop-half-way")
    try:
        assert proc.stdout is not None
        line = await asyncio.to_thread(proc.stdout.readline)
        assert line.strip() == "half", proc.stderr.read() if proc.stderr else ""
    finally:
        proc.send_signal(signal.SIGKILL)  # killed while archiving
        proc.wait()
    files = _cold_files(folder)
    assert files == [f"seq/.archived.kv.{proc.pid}.tmp"], files
    assert (folder / files[0]).stat().st_size == 2 * MIB
    await _assert_cold_miss(folder)


@pytest.mark.parametrize("mode", ["efbig", "killed-by-sigxfsz"])
async def test_a_file_size_limit_fails_the_archive_whole(tmp_path: Path, mode: str) -> None:
    folder = tmp_path / "cold"

    def limit() -> None:  # RLIMIT_FSIZE in the child only: 2 MiB, half of the blob
        resource.setrlimit(resource.RLIMIT_FSIZE, (2 * MIB, 2 * MIB))

    proc = _archiver(folder, mode, preexec=limit)
    out, err = await asyncio.to_thread(proc.communicate)
    if mode == "efbig":  # write() fails with EFBIG: a counted failure, nothing under the final name
        assert proc.returncode == 0, err
        assert json.loads(out.strip().splitlines()[-1]) == {"ok": False}
        assert _cold_files(folder) == []
    else:  # the default action of SIGXFSZ ends the process mid-write, as a crash would
        assert proc.returncode == -signal.SIGXFSZ, err
        assert [f for f in _cold_files(folder) if not f.endswith(".tmp")] == []
    await _assert_cold_miss(folder)


# --------------------------------------------------------------------------- cold: planted files


async def test_a_foreign_file_in_the_cold_folder_is_a_miss_and_is_removed(redis_db: RedisDb, tmp_path: Path) -> None:
    engine = BigKvEngine()
    store = kv_store(redis_db)
    folder = tmp_path / "cold"
    cold = ColdStore(str(folder), PREFIX)
    tiers = tiers_for(engine, store, cold)
    assert await cold.put(entry(store.key("seq", "real"), "real"))
    (folder / "seq" / "planted.kv").write_bytes(payload_for("planted"))  # another program's file
    (folder / "seq" / "copied.kv").write_bytes((folder / "seq" / "real.kv").read_bytes())  # a real one, renamed
    header, key = corrupt("cold", "header"), corrupt("cold", "key")
    for rid in ("planted", "copied"):
        req = running_request(rid, store.key("seq", rid))
        assert await tiers.restore(req) == 0  # a DRAM miss, then a refused cold file: recomputed
        assert not (folder / "seq" / f"{rid}.kv").exists()
    assert (corrupt("cold", "header"), corrupt("cold", "key")) == (header + 1, key + 1)
    print(f"\ncold: 2 planted files, {len(engine.handed)} handed to the engine")
    assert await tiers.restore(running_request("real", store.key("seq", "real"))) == 1000
    assert engine.wrong_payloads() == 0 and [rid for rid, _ in engine.handed] == ["real"]
    await tiers.aclose()


async def test_an_object_store_url_gets_the_whole_blob_in_one_write_and_refuses_a_planted_one() -> None:
    """A non-local fsspec store (fsspec's memory://, the same code path as s3:// and gs://): one pipe_file."""
    import fsspec

    cold = ColdStore("memory://switchyard-cold-test", PREFIX)
    assert not cold.local
    key = PREFIX + "kv:agent:a1"
    assert await cold.put(entry(key, "a1"))
    got = await cold.take(key)
    assert got is not None and got.payload == payload_for("a1") and got.tokens == 1000
    fs = fsspec.filesystem("memory")
    fs.pipe_file("/switchyard-cold-test/agent/a2.kv", payload_for("a2")[: MIB])  # planted, no header
    header = corrupt("cold", "header")
    assert await cold.take(PREFIX + "kv:agent:a2") is None
    assert corrupt("cold", "header") == header + 1 and not fs.exists("/switchyard-cold-test/agent/a2.kv")
