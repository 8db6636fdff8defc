"""Sim-engine settings that keep a dispatcher's steps short in tests (config overrides, dotted keys).

The latency model's shape stays; only its scale shrinks, so batching and scheduling behave as
they do at full size while a test's requests finish in milliseconds.
"""

FAST = {
    "sim.prefill_overhead_ms": 0.5,
    "sim.prefill_per_token_ms": 0.001,
    "sim.decode_base_ms": 0.5,
    "sim.decode_per_seq_ms": 0.01,
    "batching.flush_interval_ms": 2,
}
