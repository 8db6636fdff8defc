"""The load a model server reports about itself: its queue and KV cache use, read from its Prometheus ``/metrics``.

A router that counts only its own streams cannot see the server's queue (other
clients, requests it still has from a restart) nor how full its KV cache is.
Continuous-batching servers export both; each names them its own way:

=================  ==================================  ===============================  =====================================
server             requests waiting                    requests running                 KV cache used (a fraction, 0-1)
=================  ==================================  ===============================  =====================================
vLLM               ``vllm:num_requests_waiting``       ``vllm:num_requests_running``    ``vllm:kv_cache_usage_perc`` (older:
                                                                                        ``vllm:gpu_cache_usage_perc``)
SGLang             ``sglang:num_queue_reqs``           ``sglang:num_running_reqs``      ``sglang:token_usage``
TGI                ``tgi_queue_size``                  ``tgi_batch_current_size``       -
llama.cpp server   ``llamacpp:requests_deferred``      ``llamacpp:requests_processing`` ``llamacpp:kv_cache_usage_ratio``
=================  ==================================  ===============================  =====================================

(vLLM ``vllm/v1/metrics/loggers.py``; SGLang ``sglang/srt/metrics/collector.py``;
TGI ``router/src/``; llama.cpp ``tools/server/server.cpp``; the Gateway API
Inference Extension's model-server protocol names the vLLM ones.) Counts of
one name are summed over their label sets (one per served model or
data-parallel engine), KV fractions averaged. A sample that is no finite
number (a gauge read ``NaN`` before the server's first step) is no figure.
The lines of the metrics above, and only those, are parsed by
``prometheus_client``'s own parser: a server's ``/metrics`` carries hundreds
of histogram buckets the router never reads, and a line of another metric
that parser cannot read (a newer exposition's syntax, say) costs none of
these figures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs", "tgi_queue_size", "llamacpp:requests_deferred")
RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs", "tgi_batch_current_size",
           "llamacpp:requests_processing")
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage",
            "llamacpp:kv_cache_usage_ratio")
_WANTED = frozenset(WAITING + RUNNING + KV_USAGE)


@dataclass(frozen=True)
class ServerLoad:
    """One scrape's figures; None where the server exports no such metric."""

    waiting: float | None = None
    """Requests queued in the server, requests."""
    running: float | None = None
    """Requests in the server's running batch, requests."""
    kv_cache_usage: float | None = None
    """KV cache in use, a fraction in [0, 1]."""

    @property
    def known(self) -> bool:
        """True when the server exported at least one of the figures."""
        return self.waiting is not None or self.running is not None or self.kv_cache_usage is not None


def _wanted_lines(text: str) -> str:
    """The lines of ``text`` that are a sample, or a ``# TYPE`` / ``# HELP`` line, of a metric in :data:`_WANTED`:
    the metric name is what precedes a line's ``{`` or first blank (a space or a tab: the exposition format
    separates tokens by either)."""
    kept = []
    for line in text.splitlines():
        if line.startswith("#"):
            words = line.split(None, 3)
            if len(words) >= 3 and words[1] in ("TYPE", "HELP") and words[2] in _WANTED:
                kept.append(line)
        elif (name := next(iter(line.split("{", 1)[0].split()), "")) in _WANTED:  # blanks: spaces or tabs
            kept.append(line)
    return "\n".join(kept) + "\n"


def parse_server_load(text: str) -> ServerLoad:
    """The :class:`ServerLoad` in a Prometheus text exposition (``/metrics`` body), from the lines of the metrics
    it reads (:data:`WAITING`, :data:`RUNNING`, :data:`KV_USAGE`); other lines are not parsed.

    Raises:
        ValueError: a line of those metrics is not Prometheus exposition format.
    """
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for family in text_string_to_metric_families(_wanted_lines(text)):
        for sample in family.samples:
            value = float(sample.value)
            if sample.name in _WANTED and math.isfinite(value):
                sums[sample.name] = sums.get(sample.name, 0.0) + value
                counts[sample.name] = counts.get(sample.name, 0) + 1

    def first(names: tuple[str, ...], mean: bool = False) -> float | None:
        name = next((n for n in names if n in sums), None)
        if name is None:
            return None
        return sums[name] / counts[name] if mean else sums[name]

    kv = first(KV_USAGE, mean=True)  # a fraction per engine (data-parallel ranks): their mean
    waiting, running = first(WAITING), first(RUNNING)
    return ServerLoad(None if waiting is None else max(0.0, waiting), None if running is None else max(0.0, running),
                      None if kv is None else max(0.0, min(1.0, kv)))
