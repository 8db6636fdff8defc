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
    batcher = MicroBatcher(embedder, max_batch_size=5, max_wait_ms=1000)
    batcher.start()
    try:
        # All submitted before the batcher runs: batches of 5, 5 and 2, whatever the timing.
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


def test_batcher_settings_are_checked(embedder):
    with pytest.raises(ValueError, match="max_batch_size"):
        MicroBatcher(embedder, 0, 1)
    with pytest.raises(RuntimeError, match="start"):
        MicroBatcher(embedder, 1, 1).submit("q")
