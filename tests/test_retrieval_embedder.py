"""all-MiniLM-L6-v2 embeddings and the micro-batcher that shares forward passes."""

import asyncio

import numpy as np
import pytest

from switchyard.retrieval.embedder import DIMS, MODEL_NAME, Embedder, MicroBatcher, load_embedder

pytestmark = pytest.mark.slow  # loads the embedding model

QUERIES = [
    "How does the with statement work?",
    "What does yield do in a generator?",
    "How do I catch an exception?",
    "Explain operator precedence",
    "What is a lambda expression?",
    "How are class attributes looked up?",
    "What does the global statement do?",
    "How do f-strings format numbers?",
    "When is __del__ called?",
    "What is the difference between is and ==?",
    "How does import find modules?",
    "What are slices?",
]


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return load_embedder()


def test_vectors_are_384_dims_and_normalized(embedder):
    vectors = embedder.encode(QUERIES[:3])
    assert embedder.name == MODEL_NAME
    assert vectors.shape == (3, DIMS) and vectors.dtype == np.float32
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert embedder.encode([]).shape == (0, DIMS)


async def test_concurrent_queries_share_forward_passes_and_get_their_own_vectors(embedder):
    alone = np.stack([embedder.encode([q])[0] for q in QUERIES])
    batcher = MicroBatcher(embedder, max_batch_size=5, max_wait_ms=0)
    batcher.start()
    try:
        # All submitted before the batcher runs: batches of 5, 5 and 2, whatever the timing. A batch takes what is
        # queued whatever its wait, so none is needed (a wait of 1 s only held the batch of 2 open that long).
        futures = [batcher.submit(q) for q in QUERIES]
        vectors = np.stack(await asyncio.gather(*futures))
    finally:
        await batcher.stop()
    assert batcher.batch_sizes == [5, 5, 2]
    assert np.allclose(vectors, alone, atol=1e-4)
    # each query's own vector: nearest among all the individually encoded ones is itself
    assert list(np.argmax(vectors @ alone.T, axis=1)) == list(range(len(QUERIES)))


async def test_a_failed_forward_pass_reaches_every_waiter_of_its_batch(embedder):
    class Broken(Embedder):
        def encode(self, texts, batch_size=64):
            raise RuntimeError("model crashed")

    batcher = MicroBatcher(Broken(embedder.model), max_batch_size=8, max_wait_ms=0)
    batcher.start()
    try:
        futures = [batcher.submit(q) for q in QUERIES[:3]]
        results = await asyncio.gather(*futures, return_exceptions=True)
        assert [str(r) for r in results] == ["model crashed"] * 3
    finally:
        await batcher.stop()


def _cache_count(result: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("switchyard_retrieval_query_cache_total", {"result": result}) or 0.0


async def test_the_same_question_asked_concurrently_is_encoded_once_and_a_caller_giving_up_spoils_nothing(embedder):
    batcher = MicroBatcher(embedder, max_batch_size=8, max_wait_ms=1000)
    batcher.start()
    try:
        asks = [asyncio.ensure_future(batcher.embed(q)) for q in [QUERIES[0]] * 5 + [QUERIES[1]]]
        await asyncio.sleep(0)
        asks[0].cancel()  # the first asker leaves before the forward pass
        results = await asyncio.gather(*asks, return_exceptions=True)
    finally:
        await batcher.stop()
    assert isinstance(results[0], asyncio.CancelledError)
    assert batcher.batch_sizes == [2]  # two distinct texts, one forward pass
    for vector in results[1:5]:
        assert np.array_equal(vector, results[1])
    assert np.allclose(results[1], embedder.encode([QUERIES[0]])[0], atol=1e-4)
    assert not np.allclose(results[5], results[1])


async def test_a_question_asked_again_comes_from_the_cache_and_the_oldest_is_evicted(embedder):
    batcher = MicroBatcher(embedder, max_batch_size=8, max_wait_ms=0, cache_size=2)
    batcher.start()
    hits, misses = _cache_count("hit"), _cache_count("miss")
    try:
        first = await batcher.embed(QUERIES[0])
        again = await batcher.embed(QUERIES[0])
        assert again is first and batcher.batch_sizes == [1]
        assert (_cache_count("hit") - hits, _cache_count("miss") - misses) == (1, 1)
        with pytest.raises(ValueError, match="read-only"):
            again[0] = 0.0  # shared by every caller: nobody may change it
        await batcher.embed(QUERIES[1])
        await batcher.embed(QUERIES[2])  # the cache holds 2: QUERIES[0] is the least recently used
        await batcher.embed(QUERIES[0])
        assert batcher.batch_sizes == [1, 1, 1, 1]
    finally:
        await batcher.stop()


async def test_with_the_cache_off_every_question_is_encoded(embedder):
    batcher = MicroBatcher(embedder, max_batch_size=8, max_wait_ms=0, cache_size=0)
    batcher.start()
    try:
        for _ in range(3):
            await batcher.embed(QUERIES[0])
    finally:
        await batcher.stop()
    assert batcher.batch_sizes == [1, 1, 1]


def test_batcher_settings_are_checked(embedder):
    with pytest.raises(ValueError, match="max_batch_size"):
        MicroBatcher(embedder, 0, 1)
    with pytest.raises(ValueError, match="cache_size"):
        MicroBatcher(embedder, 1, 1, cache_size=-1)
    with pytest.raises(RuntimeError, match="start"):
        MicroBatcher(embedder, 1, 1).submit("q")
