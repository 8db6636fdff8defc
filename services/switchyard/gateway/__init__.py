"""The unified model gateway: one base URL, one API key, a model map, a fallback model.

Modules:

- :mod:`.client`: :class:`GatewayClient`, streamed chat completions (SSE) over a pooled ``httpx.AsyncClient`` with retries before the
  first token and fallback to ``model_gateway.fallback_model``.
- :mod:`.errors`: the error table (upstream status, transport failure, broken
  stream) as :class:`switchyard.common.errors.SwitchyardError` subclasses.
- :mod:`.events`, :mod:`.sse`, :mod:`.decode`: SSE framing and OpenAI chunk decoding (token
  deltas, tool-call deltas assembled, usage).
- :mod:`.resilience`: retries (tenacity) and fallback, before the first token only.
- :mod:`.keys`, :mod:`.redact`, :mod:`.proxy`, :mod:`.models`: API key checks
  and redaction, proxy variables, model map and nearest-id lookup.
- :mod:`.doctor`: ``switchyard doctor``. The OpenAI-compatible test server with failure
  injection (``switchyard serve sim-openai``) is the harness's :mod:`switchyard_harness.sim_openai`.
"""

from switchyard.gateway.events import ChatRequest, Finished, Token, ToolCallOut, Usage

__all__ = ["ChatRequest", "Finished", "Token", "ToolCallOut", "Usage"]
