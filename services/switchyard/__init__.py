"""Switchyard: an agent-serving gateway split by resource type.

Three gRPC services: the orchestrator (CPU: workflows, prompt rendering, token
counting, tool calls), retrieval (embeddings and vector search) and the
dispatcher (inference queue, double-buffered batching, GPU scheduling).
"""

__version__ = "0.1.0"
