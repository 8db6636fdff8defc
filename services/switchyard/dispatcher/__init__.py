"""The dispatcher: one request queue owned by the scheduler, double-buffered intake, the engine.

Modules, in the order a Generate request meets them (each module's docstring says what it owns and what
it hands to whom):

- :mod:`.service`: ``agent.InferenceService`` (``DispatcherService``): builds the engine, the
  scheduler, the loop and the processor, and hands each call to a session; ``ToolWait``.
- :mod:`.generate_stream`: a GenerateStream (or a Generate, a stream of one) as a session: the
  requests it carries, in and out.
- :mod:`.processor`: one request in and out: validation (``to_request``), submission to the loop,
  its chunks and its tracing.
- :mod:`.scheduler`: the one request queue (double buffer -> waiting ->
  running -> parked), refusal when full, expiry, KV release, priority classes,
  admission by compute score and KV memory, preemption.
- :mod:`.double_buffer`: the scheduler's intake, swapped at step boundaries;
  :mod:`.adaptive_flush` can drive its interval bound.
- :mod:`.engine_loop`: ``LoopBase``, what both engine loops share (submit, abort, every output's one path
  to its stream, the flush timer, the scheduler's reports, drain), and the step loop (prefill, decode, hand
  finished requests back); :mod:`.stream_loop`: the same for upstream engines, under the engine's
  concurrency limit (:mod:`.adaptive_limit`, one per upstream endpoint).
- :mod:`.engines`: ``sim`` (latency model), ``openai`` (upstream gateway),
  ``torch``; :func:`switchyard.dispatcher.engines.make_engine` picks one.
- :mod:`.tiers`: KV state moved out of HBM to DRAM (Redis) and the cold tier and back, and its
  pricing; the scheduler decides when.
- :mod:`.request`: one request's state, shared by all of the above;
  :mod:`.output`: its output stream, read by its session.
- :mod:`.metrics`: Prometheus metrics of batching, the engine, latency and
  scheduling; the loops publish the scheduler's reports there (the scheduler
  itself records plain data).
"""
