"""A real continuous-batching model server on this machine: ``transformers serve``.

Switchyard's ``openai`` engine is meant to sit in front of model servers nobody here
wrote. This module builds the smallest model such a server can load without any
download (a random-weight Llama from :class:`transformers.LlamaConfig` and a byte-level
BPE tokenizer trained with ``tokenizers`` on text that ships with CPython), and starts
``transformers serve MODEL --continuous-batching --device cpu`` on 127.0.0.1 serving it.

Building takes a few seconds; the server is ready to stream about 10 s after start on a
2-core machine. Its paged KV cache is capped (``--cb-num-blocks``): left to itself the
server sizes the cache to the free RAM and its first request then takes about 16 s.

Command line (for benchmarks by hand)::

    python -m switchyard_harness.testing.transformers_serve --model-dir /tmp/tiny --port 8000
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from switchyard.common import children
from switchyard_harness.arg_types import count, port

# Llama chat markup kept minimal: the tokenizer is random-weight anyway, the template only
# has to exist (``/v1/chat/completions`` refuses a tokenizer without one).
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _training_text() -> Iterator[str]:
    """Text to train the tokenizer on: CPython's documentation topics (always installed)."""
    from pydoc_data.topics import topics

    yield from topics.values()


def build_tiny_llama(out_dir: Path, *, vocab_size: int = 2048, hidden_size: int = 64,
                     layers: int = 2, max_positions: int = 4096) -> Path:
    """Write a random-weight Llama and its tokenizer into ``out_dir`` (a Hugging Face folder).

    Args:
        out_dir: folder to write ``config.json``, ``model.safetensors`` and the tokenizer
            files into; created if missing. A folder already holding a built model is
            reused as it is.
        vocab_size: BPE vocabulary size (tokens).
        hidden_size: model width; 4 attention heads, 2 of them KV heads.
        layers: decoder layers.
        max_positions: context window in tokens.

    Returns:
        ``out_dir``, loadable by ``AutoModelForCausalLM.from_pretrained`` offline.
    """
    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists() and (out_dir / "tokenizer.json").exists():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        _training_text(),
        trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False),
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
        model_max_length=max_positions,
    )
    tokenizer.chat_template = _CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=bpe.get_vocab_size(), hidden_size=hidden_size, intermediate_size=hidden_size * 2,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max_positions, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    # Tokens greedy decoding must never pick: the special tokens (an early end marker) and the
    # byte-level pieces that are not whole UTF-8 characters alone (a stream of them decodes to
    # nothing, so a server streams chunks without any text).
    silent = [i for i in range(bpe.get_vocab_size()) if i < len(specials) or "\ufffd" in bpe.decode([i])]
    with torch.no_grad():
        # Zero their (tied) rows: their logits are then 0 while the others are random around 0,
        # so greedy decoding emits text.
        model.get_input_embeddings().weight[silent] = 0.0
    model.save_pretrained(out_dir)
    # The chat template and generation defaults the server reads.
    (out_dir / "generation_config.json").write_text(json.dumps({
        "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id, "do_sample": False,
    }))
    return out_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TransformersServer:
    """``transformers serve`` on 127.0.0.1, started as a child process.

    Use as a context manager; ``base_url`` ends in ``/v1`` (what ``model_gateway.base_url``
    takes). ``kv_blocks`` × ``block_size`` tokens is the whole paged KV cache.

    The server runs in a session of its own (a Ctrl-C meant for the caller's terminal does not
    reach it), so it is ended here: :meth:`stop` (the context's exit), at this process's normal
    exit (``atexit``) where nothing stopped it, and, launched from the main thread, by the
    kernel when this process dies however it dies (``kill -9`` included: the parent-death signal,
    :mod:`switchyard.common.children`; from another thread that signal would come when that
    thread ends, so it is not asked for there). :meth:`start` is :meth:`launch` then
    :meth:`wait_ready`: a caller that waits in a worker thread launches on its own thread first.

    Raises:
        RuntimeError: the server exited or was not ready within ``start_timeout_s``; the
            message carries the tail of its output.
    """

    def __init__(self, model_dir: Path, *, port: int = 0, kv_blocks: int = 512, block_size: int = 32,
                 max_batch_tokens: int = 256, start_timeout_s: float = 120.0,
                 extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> None:
        self.model_dir = Path(model_dir)
        self.port = port or free_port()
        self.kv_blocks = kv_blocks
        self.block_size = block_size
        self.max_batch_tokens = max_batch_tokens
        self.start_timeout_s = start_timeout_s
        self.extra_args = extra_args
        self.env = env or {}
        """Extra environment variables of the server process (e.g. PYTHONPATH to a logging set-up)."""
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_path: Path | None = None
        self._lock = threading.Lock()  # launch and stop, from different threads
        self._stopped = False

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def model(self) -> str:
        """The model id requests name (the served folder's path, as the server reports it)."""
        return str(self.model_dir)

    def command(self) -> list[str]:
        exe = Path(sys.executable).with_name("transformers")
        return [
            str(exe) if exe.exists() else "transformers", "serve", str(self.model_dir),
            "--continuous-batching", "--device", "cpu", "--dtype", "float32",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--cb-num-blocks", str(self.kv_blocks), "--cb-block-size", str(self.block_size),
            "--cb-max-batch-tokens", str(self.max_batch_tokens),
            "--log-level", "warning", *self.extra_args,
        ]

    def start(self) -> "TransformersServer":
        """:meth:`launch` and :meth:`wait_ready`."""
        self.launch()
        return self.wait_ready()

    def launch(self) -> None:
        """Start the server process (not waiting for it to serve). Call it on the main thread, so that the
        server ends if this process dies (see the class docstring).

        Raises:
            RuntimeError: :meth:`stop` ran first (the caller is stopping).
        """
        import tempfile

        with self._lock:
            if self._stopped:
                raise RuntimeError("transformers serve: stopped before it was launched")
            fd, log = tempfile.mkstemp(prefix="transformers-serve-", suffix=".log")
            self._log_path = Path(log)
            env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                   "TOKENIZERS_PARALLELISM": "false", **self.env}
            try:
                self.proc = subprocess.Popen(
                    children.dying_with_parent(self.command(), signal.SIGTERM), stdout=fd,
                    stderr=subprocess.STDOUT, env=env, start_new_session=True)
            finally:
                os.close(fd)
            atexit.register(self.stop)

    def wait_ready(self) -> "TransformersServer":
        """Wait until the server serves (its ``/health``) and has streamed one request; safe in a worker thread.

        Raises:
            RuntimeError: it exited (stopped meanwhile too) or was not ready within ``start_timeout_s``.
        """
        assert self.proc is not None, "launch() first"
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"transformers serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=1.0).status_code == 200:
                    self._warm_up()
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"transformers serve not ready in {self.start_timeout_s:.0f} s:\n{self.log_tail()}")

    def _warm_up(self) -> None:
        """One streamed request, so the model is loaded and the batching loop running."""
        with httpx.stream("POST", f"{self.base_url}/chat/completions", timeout=self.start_timeout_s, json={
            "model": self.model, "stream": True, "max_tokens": 2,
            "messages": [{"role": "user", "content": "hello"}],
        }) as response:
            response.raise_for_status()
            for _ in response.iter_lines():
                pass

    def log_tail(self, chars: int = 4000) -> str:
        if self._log_path is None or not self._log_path.exists():
            return ""
        return self._log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        """End the server (SIGTERM to its session, SIGKILL after 10 s); one not launched yet never will be.
        Safe from any thread, more than once."""
        with self._lock:
            self._stopped = True
        atexit.unregister(self.stop)
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        if self._log_path is not None:
            with contextlib.suppress(FileNotFoundError):
                self._log_path.unlink()

    def __enter__(self) -> "TransformersServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, required=True, help="where to build (or find) the tiny Llama")
    parser.add_argument("--port", type=port, default=8000, help="default 8000; 0: a free one")
    parser.add_argument("--kv-blocks", type=count, default=512, help="paged KV cache blocks (32 tokens each)")
    args = parser.parse_args(argv)
    build_tiny_llama(args.model_dir)
    # SIGTERM stops the server too (it runs in its own session, so it would outlive this process).
    signal.signal(signal.SIGTERM, _interrupt)
    with TransformersServer(args.model_dir, port=args.port, kv_blocks=args.kv_blocks) as server:
        print(f"transformers serve ready: base_url {server.base_url}  model {server.model}", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while server.proc is not None and server.proc.poll() is None:
                time.sleep(1)
            # the server exited on its own (killed, crashed): say so, with its last words, before they are removed
            status = server.proc.returncode if server.proc is not None else None
            print(f"transformers serve exited with status {status} while serving; its log ends:\n{server.log_tail()}",
                  file=sys.stderr, flush=True)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
