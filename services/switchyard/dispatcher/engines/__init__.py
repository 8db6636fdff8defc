"""Inference engines and the factory that picks one from config.

``dispatcher.engine`` (or ``SWITCHYARD_ENGINE``) chooses:

- ``sim``: :class:`switchyard.dispatcher.engines.sim.SimEngine`, a latency
  model with deterministic text; no GPU, no weights (the default).
- ``openai``: ``switchyard.dispatcher.engines.openai.OpenAIEngine``, any
  OpenAI-compatible upstream (imported only when chosen).
- ``torch``: ``switchyard.dispatcher.engines.torch.TorchEngine``, an
  in-process transformer (imported only when chosen).

Modules: :mod:`.base`, the interfaces the dispatcher drives (step and stream engines, their KV cache
managers); :mod:`.sim`, :mod:`.openai` and :mod:`.torch` (its model: :mod:`.torch_model`), the engines;
:mod:`.prefix_cache`, the sim engine's automatic prefix cache; :mod:`.token_ratio`, the model server's prompt
tokens per counted one, learnt per model by the ``openai`` engine; :mod:`.driver`, a step engine driven
without a scheduler (the engine benchmark and tests).
"""

from __future__ import annotations

from typing import Callable

from switchyard.common.config import SwitchyardConfig
from switchyard.common.errors import SwitchyardError
from switchyard.dispatcher.engines.base import (
    KVCacheManager,
    NullKVCacheManager,
    Reasoning,
    SeqOutput,
    StepBatch,
    StepEngine,
    StepResult,
    StreamEngine,
    StreamItem,
    Usage,
)

__all__ = ["KVCacheManager", "NullKVCacheManager", "Reasoning", "SeqOutput", "StepBatch", "StepEngine", "StepResult", "StreamEngine",
           "StreamItem", "Usage", "EngineUnavailable", "make_engine"]

# engine name -> the function that imports its class; modules are imported lazily so the sim
# engine's image needs neither httpx upstream set-up nor torch.


def _sim() -> type[StepEngine]:
    from switchyard.dispatcher.engines.sim import SimEngine

    return SimEngine


def _openai() -> type[StreamEngine]:
    from switchyard.dispatcher.engines.openai import OpenAIEngine

    return OpenAIEngine


def _torch() -> type[StepEngine]:
    from switchyard.dispatcher.engines.torch import TorchEngine

    return TorchEngine


_ENGINES: dict[str, Callable[[], type[StepEngine] | type[StreamEngine]]] = {
    "sim": _sim,
    "openai": _openai,
    "torch": _torch,
}


class EngineUnavailable(SwitchyardError):
    """The configured engine's module or its libraries are not installed."""


def make_engine(config: SwitchyardConfig) -> StepEngine | StreamEngine:
    """Build the engine named by ``config.dispatcher.engine``.

    Each engine class takes the whole :class:`SwitchyardConfig`.

    Raises:
        EngineUnavailable: the engine's module (or a library it needs, such as
            torch) is not installed; the message names the engine and the
            extra to install.
    """
    name = config.dispatcher.engine
    try:
        engine_class = _ENGINES[name]()
    except ModuleNotFoundError as exc:
        raise EngineUnavailable(
            f"{name} engine not installed (missing module {exc.name!r}); "
            f"install the extra (pip install -e '.[{name if name == 'torch' else 'dispatcher'}]' from the repository root) "
            f"or set dispatcher.engine / SWITCHYARD_ENGINE to 'sim'"
        ) from None
    return engine_class(config)
