"""The cold tier on ``s3://`` (issue 26, item 1): s3fs against a real S3 server on 127.0.0.1 (moto's server).

The faults of test_stored_blobs.py on the object-store path: a write that raises part-way leaves no object
under the final key, a promoted blob is a hit only when whole, a planted foreign object is a counted miss, and
a multipart upload that is never completed is invisible. S3 itself is the edge of the world here: moto's
server speaks its HTTP API; everything of Switchyard's (ColdStore, MemoryTiers, the DRAM tier on a real Redis)
is the real code, reached through ``[oss] storage_options``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from redis_fixtures import RedisDb, redis_db, redis_server, start_redis  # noqa: F401
from test_stored_blobs import MIB, PREFIX, BigKvEngine, corrupt, entry, kv_store, metric, payload_for, \
    running_request, tiers_for

from switchyard.common.config import SwitchyardConfig
from switchyard.dispatcher.tiers import ColdStore
from switchyard.dispatcher.tiers import blob as blob_mod

boto3 = pytest.importorskip("boto3")
pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

pytestmark = pytest.mark.no_gpu
BUCKET = "switchyard-cold"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing",
               "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    """A moto S3 server on a free port of 127.0.0.1 with fake credentials in the environment; its URL."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in CREDENTIALS.items():
            patch.setenv(name, value)
        for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
            patch.delenv(name, raising=False)
        server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        url = f"http://{host}:{port}"
        boto3.client("s3", endpoint_url=url).create_bucket(Bucket=BUCKET)
        try:
            yield url
        finally:
            server.stop()


@pytest.fixture
def s3(s3_endpoint: str) -> Any:
    """A boto3 client of the server, to plant and list objects behind the cold tier's back."""
    return boto3.client("s3", endpoint_url=s3_endpoint)


def cold_store(endpoint: str, prefix: str) -> ColdStore:
    """The ColdStore a dispatcher builds from ``[oss]`` (path and storage_options through the config model)."""
    config = SwitchyardConfig()
    oss = config.memory.oss.model_validate({"path": f"s3://{BUCKET}/{prefix}",
                                            "storage_options": {"client_kwargs": {"endpoint_url": endpoint}}})
    return ColdStore(oss.path, PREFIX, oss.storage_options)


def objects(s3: Any, prefix: str) -> list[str]:
    """Keys under ``prefix``, asked of the server (no s3fs listing cache)."""
    listed = s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    return sorted(o["Key"] for o in listed.get("Contents", []))


def test_storage_options_reach_the_filesystem(s3_endpoint: str) -> None:
    cold = cold_store(s3_endpoint, "options")
    assert not cold.local and cold.fs.client_kwargs == {"endpoint_url": s3_endpoint}


async def test_a_write_that_raises_part_way_leaves_no_object_then_a_whole_one_is_a_hit(
        redis_db: RedisDb, s3_endpoint: str, s3: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = BigKvEngine()
    store = kv_store(redis_db)
    cold = cold_store(s3_endpoint, "raises")
    tiers = tiers_for(engine, store, cold)
    key = store.key("seq", "stale")
    errors = metric("switchyard_cold_tier_errors_total", operation="put")
    real_digest = blob_mod._digest
    fed: list[int] = []

    def digest_then_raise(*parts: bytes) -> bytes:  # the serializer raising half-way through the 4 MiB payload
        fed.append(sum(len(p) for p in parts))
        real_digest(*(p[: len(p) // 2] for p in parts))
        raise RuntimeError("serializer failed half-way")

    with monkeypatch.context() as patch:
        patch.setattr(blob_mod, "_digest", digest_then_raise)
        assert not await cold.put(entry(key, "stale"))
    assert fed and fed[0] > 4 * MIB
    assert metric("switchyard_cold_tier_errors_total", operation="put") == errors + 1
    assert objects(s3, "raises/") == [], "nothing under the final key"
    assert await cold.take(key) is None
    # the same write, unhindered, is one whole object; promoted, it is the request's own state
    assert await cold.put(entry(key, "stale"))
    assert objects(s3, "raises/") == ["raises/seq/stale.kv"]
    assert await tiers.restore(running_request("stale", key)) == 1000
    assert engine.wrong_payloads() == 0 and [rid for rid, _ in engine.handed] == ["stale"]
    assert objects(s3, "raises/") == [], "a promoted entry leaves the cold tier"
    await tiers.aclose()


async def test_a_promoted_blob_is_a_hit_only_when_whole_and_a_foreign_object_is_a_counted_miss(
        redis_db: RedisDb, s3_endpoint: str, s3: Any) -> None:
    engine = BigKvEngine()
    store = kv_store(redis_db)
    cold = cold_store(s3_endpoint, "planted")
    tiers = tiers_for(engine, store, cold)
    assert await cold.put(entry(store.key("seq", "real"), "real"))
    sealed = s3.get_object(Bucket=BUCKET, Key="planted/seq/real.kv")["Body"].read()
    assert await cold.put(entry(store.key("seq", "flipped"), "flipped"))
    damaged = bytearray(s3.get_object(Bucket=BUCKET, Key="planted/seq/flipped.kv")["Body"].read())
    damaged[len(damaged) // 2] ^= 0x01
    planted = {  # request id -> (object body, the reason it must be refused for)
        "foreign": (payload_for("foreign"), "header"),  # another program's object
        "copied": (sealed, "key"),  # a whole blob, copied under another key
        "half": (sealed[: len(sealed) // 2], "length"),  # cut short, as a PUT of half the body would leave it
        "flipped": (bytes(damaged), "checksum"),  # one bit of its own blob, flipped in the store
    }
    for rid, (body, _) in planted.items():
        s3.put_object(Bucket=BUCKET, Key=f"planted/seq/{rid}.kv", Body=body)
    before = {reason: corrupt("cold", reason) for reason in blob_mod.REASONS}
    misses = metric("switchyard_tier_misses_total", tier="cold")
    for rid in planted:
        req = running_request(rid, store.key("seq", rid))
        assert await tiers.restore(req) == 0 and req.recomputed_tokens == 1000
    print(f"\ns3 (moto): {len(planted)} planted objects, {len(engine.handed)} handed to the engine")
    assert engine.handed == []
    assert {r: corrupt("cold", r) - before[r] for r in blob_mod.REASONS} == {r: 1 for r in blob_mod.REASONS}
    assert metric("switchyard_tier_misses_total", tier="cold") == misses + len(planted)
    assert objects(s3, "planted/") == ["planted/seq/real.kv"], "refused objects are removed"
    assert await tiers.restore(running_request("real", store.key("seq", "real"))) == 1000
    assert engine.wrong_payloads() == 0 and [rid for rid, _ in engine.handed] == ["real"]
    await tiers.aclose()


async def test_a_multipart_upload_never_completed_is_not_visible(s3_endpoint: str, s3: Any) -> None:
    cold = cold_store(s3_endpoint, "multipart")
    key = PREFIX + "kv:seq:parts"
    sealed = blob_mod.seal(key, {"tokens": 1000}, payload_for("parts", 12 * MIB))
    upload = s3.create_multipart_upload(Bucket=BUCKET, Key="multipart/seq/parts.kv")
    for number, start in enumerate(range(0, 10 * MIB, 5 * MIB), start=1):  # two 5 MiB parts of three
        s3.upload_part(Bucket=BUCKET, Key="multipart/seq/parts.kv", UploadId=upload["UploadId"],
                       PartNumber=number, Body=sealed[start:start + 5 * MIB])
    assert len(s3.list_parts(Bucket=BUCKET, Key="multipart/seq/parts.kv",
                             UploadId=upload["UploadId"])["Parts"]) == 2
    assert objects(s3, "multipart/") == []
    errors = metric("switchyard_cold_tier_errors_total", operation="get")
    assert await cold.take(key) is None, "an upload in progress is a plain miss"
    assert metric("switchyard_cold_tier_errors_total", operation="get") == errors
    s3.abort_multipart_upload(Bucket=BUCKET, Key="multipart/seq/parts.kv", UploadId=upload["UploadId"])
    assert objects(s3, "multipart/") == []
