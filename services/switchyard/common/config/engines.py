"""``switchyard.json`` ``sim`` and ``torch``: the in-process engines' models."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from switchyard.common.config.base import _Strict


class SimEngineConfig(_Strict):
    """Latency model of the ``sim`` engine (see engines/sim.py for sources): ``switchyard.json`` ``sim``."""

    model: str = Field("sim-7b", min_length=1, description="Model id reported in GenerateDone.model.")
    prefill_overhead_ms: float = Field(5.0, ge=0, description="Fixed cost of one prefill, milliseconds.")
    prefill_per_token_ms: float = Field(0.025, ge=0, description="Prefill cost per prompt token, milliseconds.")
    decode_base_ms: float = Field(4.2, ge=0, description="Fixed cost of one decode step, milliseconds.")
    decode_per_seq_ms: float = Field(
        0.15, ge=0, description="Decode-step cost per sequence in the batch, milliseconds."
    )
    kv_bytes_per_token: int = Field(524_288, ge=0, description="KV cache per token, bytes.")
    params_billion: float = Field(
        7.0, gt=0, le=10_000, description="Model parameters, billions: 2 x params FLOPs per token for tensor activity."
    )
    peak_tflops: float = Field(989.0, gt=0, description="Dense BF16 tensor peak of the modelled GPU, TFLOP/s (H100 SXM).")
    hbm_tb_per_s: float = Field(3.35, gt=0, description="HBM bandwidth of the modelled GPU, TB/s (H100 SXM).")
    bytes_per_param: float = Field(2.0, gt=0, description="Weight bytes per parameter, bytes (2 = fp16/bf16).")
    hbm_gb: float = Field(80.0, gt=0, description="Device memory of the modelled GPU, GB (H100 SXM: 80).")
    prefix_caching: bool = Field(
        True, description="Reuse the KV of prompt blocks already computed (vLLM's automatic prefix caching)."
    )
    prefix_block_tokens: int = Field(16, ge=1, le=4096, description="Tokens per cached prompt block, tokens.")
    layers: int = Field(
        32, ge=1, le=1024,
        description="Transformer layers of the modelled model, layers (Llama-2-7B: 32): a step in flight can be "
        "interrupted for a core prefill at each layer boundary, every step time / layers seconds.",
    )


class TorchEngineConfig(_Strict):
    """The ``torch`` engine: an in-process decoder-only transformer (see dispatcher/engines/torch_model.py).

    The defaults are a small model that runs on a CPU; docs/engines.md lists a
    GPU preset (the shape of TinyLlama-1.1B). ``switchyard.json`` ``torch``.
    """

    model: str = Field("torch-tiny", min_length=1, description="Model id reported in GenerateDone.model.")
    device: str = Field(
        "auto", min_length=1, description='Torch device, a name: "auto" (cuda when available, else cpu), "cpu", "cuda", "cuda:N".'
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weight and activation dtype, a name; auto: bfloat16 on cuda, float32 on cpu."
    )
    n_layers: int = Field(4, ge=1, le=256, description="Transformer blocks, layers.")
    d_model: int = Field(256, ge=8, le=65_536, description="Hidden size, features; a multiple of n_heads.")
    n_heads: int = Field(
        8, ge=1, le=1024, description="Attention heads, heads; d_model / n_heads is the head size (even, for rotary)."
    )
    d_ff: int = Field(1024, ge=8, le=262_144, description="Hidden size of the SwiGLU MLP, features.")
    vocab_size: int = Field(
        8192, ge=258, le=100_256,
        description="Model vocabulary, token ids: cl100k_base's first vocab_size - 1 merge ranks, plus one end-of-text id.",
    )
    max_seq_len: int = Field(8192, ge=16, le=1_048_576, description="Most tokens (prompt + output) one sequence holds, tokens.")
    seed: int = Field(0, ge=0, le=2**63 - 1, description="Seed of the dummy weights and of sampling, an integer.")
    temperature: float = Field(0.0, ge=0, le=100, description="Sampling temperature, unitless; 0: greedy; > 0: seeded sampling per sequence.")
    ignore_eos: bool = Field(
        False, description="Keep generating past the end-of-text id (benchmarks, as vLLM's ignore_eos)."
    )
    kv_block_tokens: int = Field(16, ge=1, le=4096, description="The KV cache of a sequence grows by this many tokens, tokens.")
    prefill_chunk_tokens: int = Field(
        512, ge=1, le=1_048_576,
        description="Prefill computes at most this many tokens of a sequence per forward, tokens (chunked prefill), "
        "which bounds the attention activations of long prompts.",
    )
    threads: int = Field(0, ge=0, le=1024, description="Torch intra-op CPU threads, threads; 0 = torch's default.")
    checkpoint: str = Field("", description="Path of a checkpoint saved by this engine; empty: dummy random weights.")

    @field_validator("device")
    @classmethod
    def _device_name(cls, value: str) -> str:
        """'gpu' or 'cuda:x' loaded, and the dispatcher's start failed in torch's words, naming no key."""
        if not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", value):
            raise ValueError("auto, cpu, cuda or cuda:N (a torch device this engine runs on)")
        return value

    @model_validator(mode="after")
    def _heads(self) -> "TorchEngineConfig":
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError(
                f"d_model ({self.d_model}) must be n_heads ({self.n_heads}) x an even head size"
            )
        return self
