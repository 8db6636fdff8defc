"""Switchyard: an agent-serving gateway split by resource type.

Three gRPC services: the orchestrator (CPU: workflows, prompt rendering, token
counting, tool calls), retrieval (embeddings and vector search) and the
dispatcher (inference queue, double-buffered batching, GPU scheduling).
"""

from switchyard.common.envs import set_library_defaults

# Before any module of the package can import onnxruntime: its usage telemetry is off in every
# process that runs Switchyard code (the services of `switchyard up` inherit it), see envs.LIBRARY_DEFAULTS.
set_library_defaults()

__version__ = "0.1.0"
