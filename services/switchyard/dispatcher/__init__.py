"""The dispatcher: one request queue owned by the scheduler, double-buffered intake, the engine.

Modules, in the order a Generate request meets them:

- :mod:`.service`: ``agent.InferenceService`` (``DispatcherService``): validation,
  the Generate stream.
- :mod:`.scheduler`: the one request queue (double buffer -> waiting ->
  running -> parked), refusal when full, expiry, KV release, priority classes,
  admission by compute score and KV memory, preemption.
- :mod:`.double_buffer`: the scheduler's intake, swapped at step boundaries;
  :mod:`.adaptive_flush` can drive its interval bound.
- :mod:`.engine_loop`: the step loop (prefill, decode, hand finished requests
  back); :mod:`.stream_loop`: the same for upstream engines, bounded by
  :mod:`.adaptive_limit`.
- :mod:`.engines`: ``sim`` (latency model), ``openai`` (upstream gateway),
  ``torch``; :func:`switchyard.dispatcher.engines.make_engine` picks one.
- :mod:`.request`: one request's state, shared by all of the above;
  :mod:`.output`: its output stream, read by the Generate handler.
- :mod:`.metrics`: Prometheus metrics of batching, the engine, latency and
  scheduling; the loops publish the scheduler's reports there (the scheduler
  itself records plain data).
"""
