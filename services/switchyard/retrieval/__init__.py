"""Retrieval: embeds queries and searches a vector index of documentation passages.

- :mod:`.service`: ``RetrievalService`` (``agent.RetrievalService.Retrieve``) behind the retrieval queue.
- :mod:`.embedder`: all-MiniLM-L6-v2 (offline, 384 dims) and the query micro-batcher.
- :mod:`.index`: the FAISS index and its passages on disk.
- :mod:`.indexer`: ``switchyard index``; :mod:`.documents` and :mod:`.chunking` feed it.
- :mod:`.metrics`: the service's Prometheus metrics.

Nothing heavy is imported here, so ``switchyard index --help`` stays fast.
"""
