"""Switchyard's measuring path, kept apart from the serving path (``services/switchyard``).

- :mod:`switchyard_harness.bench`: ``switchyard bench ...``: the ghz-compatible load generator,
  the A/B scenarios and every benchmark main (scheduler, isolation, agents, routing, pool,
  fault, upstream, HTTP face, retrieval, the orchestrator's loop lag, the torch engine).
- :mod:`switchyard_harness.sim_openai`: ``switchyard serve sim-openai``, the fake OpenAI-compatible
  upstream (streaming, failure injection, a continuous-batching latency model).
- :mod:`switchyard_harness.top`: ``switchyard top``; :mod:`switchyard_harness.cpu_profile`:
  ``switchyard profile``: the operator's views of a running stack, read from its endpoints.
- :mod:`switchyard_harness.testing`: test tooling (a real ``transformers serve`` on a tiny model).

The services never import this package; the ``switchyard`` command imports it only when one of
the commands above runs. It is installed by the same ``pyproject.toml`` (``pip install .`` from
a checkout); the service images leave it out.
"""
