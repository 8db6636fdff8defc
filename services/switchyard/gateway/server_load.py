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
data-parallel engine), KV fractions averaged. The text is
parsed by ``prometheus_client``'s own parser.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs", "tgi_queue_size", "llamacpp:requests_deferred")
RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs", "tgi_batch_current_size",
           "llamacpp:requests_processing")
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage",
            "llamacpp:kv_cache_usage_ratio")


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


def parse_server_load(text: str) -> ServerLoad:
    """The :class:`ServerLoad` in a Prometheus text exposition (``/metrics`` body).

    Raises:
        ValueError: the text is not Prometheus exposition format.
    """
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    wanted = set(WAITING + RUNNING + KV_USAGE)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                sums[sample.name] = sums.get(sample.name, 0.0) + float(sample.value)
                counts[sample.name] = counts.get(sample.name, 0) + 1

    def first(names: tuple[str, ...], mean: bool = False) -> float | None:
        name = next((n for n in names if n in sums), None)
        if name is None:
            return None
        return sums[name] / counts[name] if mean else sums[name]

    kv = first(KV_USAGE, mean=True)  # a fraction per engine (data-parallel ranks): their mean
    return ServerLoad(first(WAITING), first(RUNNING), None if kv is None else max(0.0, min(1.0, kv)))
