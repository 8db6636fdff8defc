"""The unified model gateway: one base URL, one API key, a model map, a fallback model.

Modules:

- :mod:`.client`: :class:`GatewayClient`, streamed chat completions (SSE) over one pooled ``httpx.AsyncClient`` per endpoint, with retries before
  the first token and fallback to ``model_gateway.fallback_model``; :mod:`.transport`: aiohttp under httpx's
  client API (``model_gateway.http_transport`` "aiohttp").
- :mod:`.errors`: the error table (upstream status, transport failure, broken
  stream) as :class:`switchyard.common.errors.SwitchyardError` subclasses; :mod:`.classify`: an upstream's
  status or a transport failure mapped to them.
- :mod:`.events`, :mod:`.sse`, :mod:`.decode`: SSE framing and OpenAI chunk decoding (token
  deltas, tool-call deltas assembled, usage).
- :mod:`.resilience`: retries (tenacity) and fallback, before the first token only; :mod:`.cooldown`: each
  model's circuit breaker and the waits its server asked for.
- :mod:`.pool`: the model server's replicas (endpoints), their health, load and limits; :mod:`.picker`: which
  one takes a call (filter -> score -> pick); :mod:`.server_load`: the queue and KV use a server reports;
  :mod:`.servers`: which server it is and how it takes a priority.
- :mod:`.keys`, :mod:`.redact`, :mod:`.proxy`, :mod:`.models`: API key checks
  and redaction, proxy variables, model map and nearest-id lookup.
- :mod:`.metrics`: its Prometheus metrics (model ids and status names as labels, never keys).
- :mod:`.doctor`: ``switchyard doctor``. The OpenAI-compatible test server with failure
  injection (``switchyard serve sim-openai``) is the harness's :mod:`switchyard_harness.sim_openai`, its faults
  :mod:`switchyard_harness.faults`.
"""

from switchyard.gateway.events import ChatRequest, Finished, Reasoning, Token, ToolCallOut, Usage

__all__ = ["ChatRequest", "Finished", "Reasoning", "Token", "ToolCallOut", "Usage"]
