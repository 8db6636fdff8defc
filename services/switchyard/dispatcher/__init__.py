"""The dispatcher: inference queue, double-buffered batching, scheduling and the engine.

Modules, in the order a Generate request meets them:

- :mod:`.service`: ``agent.InferenceService`` (``DispatcherService``): validation,
  the Generate stream.
- :mod:`.inference_queue`: the bounded inference queue (places held until the
  engine takes the request).
- :mod:`.double_buffer`: two swapped lists, flushed by size, interval or drain;
  :mod:`.adaptive_flush` can drive the interval.
- :mod:`.engine_loop`: flushed batches -> scheduling policy -> engine steps
  (iteration-level batching), or stream workers for stream engines.
- :mod:`.scheduler`: priority classes, admission by compute score, preemption,
  reclaiming the slots of agents waiting on tools.
- :mod:`.engines`: ``sim`` (latency model), ``openai`` (upstream gateway),
  ``torch``; :func:`switchyard.dispatcher.engines.make_engine` picks one.
- :mod:`.sequence`: one request's state, shared by all of the above.
- :mod:`.metrics`: Prometheus metrics of batching, the engine and latency.
"""
