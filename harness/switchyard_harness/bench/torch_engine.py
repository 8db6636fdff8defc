"""The torch engine's benchmark: prefill time, decode step time and decode tokens/s per batch size.

    python -m switchyard_harness.bench.torch_engine --batch 1,8,32            # the configured model
    python -m switchyard_harness.bench.torch_engine --batch 1,8,32 --preset gpu --device cuda
    python -m switchyard_harness.bench.torch_engine --save-checkpoint tiny.pt  # write the weights

Drives :class:`switchyard.dispatcher.engines.torch.TorchEngine` directly (no scheduler, no gRPC):
one warm-up sequence, then for each batch size one batched prefill of ``--prompt-tokens`` tokens
per sequence and ``--steps`` batched decode steps; the engine's ``busy_seconds`` (forward wall
time, after ``torch.cuda.synchronize`` on CUDA) is what is timed. ``ignore_eos`` is on, so every
sequence decodes every step.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys

import torch

from switchyard.common.config import load_config
from switchyard.dispatcher.engines.driver import EngineDriver
from switchyard.dispatcher.engines.torch import TorchEngine
from switchyard.dispatcher.request import Request

GPU_PRESET = {"n_layers": 22, "d_model": 2048, "n_heads": 32, "d_ff": 5632, "vocab_size": 32000, "max_seq_len": 4096}
"""TinyLlama-1.1B's shape (22 layers, hidden 2048, 32 heads, MLP 5632, vocab 32000), for a GPU."""

_BENCH_TEXT = (
    "Switchyard splits agent work by resource: orchestration and retrieval on CPU queues, "
    "inference on a batching scheduler in front of the GPU. "
)


def _bench_requests(engine: TorchEngine, batch: int, prompt_tokens: int, steps: int, tag: str) -> list[Request]:
    ids = engine.tokenizer.encode(_BENCH_TEXT * (prompt_tokens // 8 + 1))[:prompt_tokens]
    text = engine.tokenizer.decode(ids)
    return [Request(request_id=f"{tag}-{i}", prompt=text, max_tokens=steps + 2) for i in range(batch)]


async def _bench(engine: TorchEngine, batches: list[int], prompt_tokens: int, steps: int) -> list[tuple]:
    drive = EngineDriver(engine)  # the engine without a scheduler: execute_model, the scheduler's stop check
    rows = []
    warm = _bench_requests(engine, 1, prompt_tokens, 2, "warmup")
    await drive.prefill(warm)
    await drive.decode(warm)
    drive.end(warm)
    for batch in batches:
        reqs = _bench_requests(engine, batch, prompt_tokens, steps, f"b{batch}")
        before = engine.busy_seconds
        await drive.prefill(reqs)
        prefill_s = engine.busy_seconds - before
        step_s = []
        for _ in range(steps):
            before = engine.busy_seconds
            await drive.decode(reqs)
            step_s.append(engine.busy_seconds - before)
        kv = sum(engine.kv.kv_bytes(s) for s in reqs)
        drive.end(reqs)
        median = statistics.median(step_s)
        rows.append((batch, prefill_s, median, batch / median, kv))
    return rows


def main(argv: list[str]) -> int:
    """``python -m switchyard_harness.bench.torch_engine``: decode step time and tokens/s per batch size."""
    parser = argparse.ArgumentParser(prog="python -m switchyard_harness.bench.torch_engine", description=main.__doc__)
    parser.add_argument("--batch", default="1,8,32", help="comma-separated batch sizes (default 1,8,32)")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="prompt length per sequence (default 128)")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per batch size (default 32)")
    parser.add_argument("--preset", choices=("config", "gpu"), default="config",
                        help="config: the torch section as configured; gpu: TinyLlama-1.1B's shape")
    parser.add_argument("--device", help="override torch.device (auto, cpu, cuda)")
    parser.add_argument("--dtype", help="override torch.dtype (auto, float32, bfloat16, float16)")
    parser.add_argument("--config-dir", help="config folder (default SWITCHYARD_CONFIG_DIR or config/)")
    parser.add_argument("--save-checkpoint", metavar="PATH", help="write the model's weights to PATH and exit")
    args = parser.parse_args(argv)
    try:
        batches = [int(b) for b in args.batch.split(",") if b.strip()]
    except ValueError:
        parser.error(f"--batch: expected comma-separated integers, got {args.batch!r}")
    if not batches or min(batches) < 1 or args.steps < 1 or args.prompt_tokens < 1:
        parser.error("--batch, --steps and --prompt-tokens: expected positive integers")

    config = load_config(args.config_dir)
    overrides: dict[str, object] = {"torch.ignore_eos": True}
    if args.preset == "gpu":
        overrides.update({f"torch.{key}": value for key, value in GPU_PRESET.items()})
    if args.device:
        overrides["torch.device"] = args.device
    if args.dtype:
        overrides["torch.dtype"] = args.dtype
    config = config.with_overrides(**overrides)
    limit = config.torch.max_seq_len
    if args.prompt_tokens + args.steps + 2 >= limit:
        parser.error(f"--prompt-tokens + --steps must stay below torch.max_seq_len ({limit})")

    engine = TorchEngine(config)
    p = engine.params
    if args.save_checkpoint:
        from switchyard.dispatcher.engines.torch_model import save_checkpoint

        save_checkpoint(engine.model_net, args.save_checkpoint)
        print(f"wrote {args.save_checkpoint}")
        return 0
    params = sum(t.numel() for t in engine.model_net.parameters())
    print(
        f"model {p.n_layers} layers x d_model {p.d_model}, {p.n_heads} heads, d_ff {p.d_ff}, vocab {p.vocab_size} "
        f"({params / 1e6:.1f} M parameters) on {engine.device} {engine.model_net.embed.weight.dtype}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads"
    )
    print(f"prompt {args.prompt_tokens} tokens, {args.steps} decode steps per batch size (median step shown)")
    print(f"{'batch':>5} {'prefill_s':>10} {'decode_step_ms':>15} {'decode_tok_s':>13} {'kv_mib':>8}")
    for batch, prefill_s, step_s, tok_s, kv in asyncio.run(_bench(engine, batches, args.prompt_tokens, args.steps)):
        print(f"{batch:>5} {prefill_s:>10.4f} {step_s * 1000:>15.2f} {tok_s:>13.1f} {kv / 2**20:>8.1f}")
    return 0


__all__ = ["GPU_PRESET", "main"]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
