"""Inference engines and the factory that picks one from config.

``dispatcher.engine`` (or ``SWITCHYARD_ENGINE``) chooses:

- ``sim``: :class:`switchyard.dispatcher.engines.sim.SimEngine`, a latency
  model with deterministic text; no GPU, no weights (the default).
- ``openai``: ``switchyard.dispatcher.engines.openai.OpenAIEngine``, any
  OpenAI-compatible upstream (imported only when chosen).
- ``torch``: ``switchyard.dispatcher.engines.torch.TorchEngine``, an
  in-process transformer (imported only when chosen).
"""

from __future__ import annotations

import importlib

from switchyard.common.config import SwitchyardConfig
from switchyard.common.errors import SwitchyardError
from switchyard.dispatcher.engines.base import (
    KVCacheManager,
    NullKVCacheManager,
    SeqOutput,
    StepBatch,
    StepEngine,
    StepResult,
    StreamEngine,
    StreamItem,
    Usage,
)

__all__ = ["KVCacheManager", "NullKVCacheManager", "SeqOutput", "StepBatch", "StepEngine", "StepResult", "StreamEngine",
           "StreamItem", "Usage", "EngineUnavailable", "make_engine"]

# engine name -> (module, class); modules are imported lazily so the sim
# engine's image needs neither httpx upstream set-up nor torch.
_ENGINES: dict[str, tuple[str, str]] = {
    "sim": ("switchyard.dispatcher.engines.sim", "SimEngine"),
    "openai": ("switchyard.dispatcher.engines.openai", "OpenAIEngine"),
    "torch": ("switchyard.dispatcher.engines.torch", "TorchEngine"),
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
    module_name, class_name = _ENGINES[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise EngineUnavailable(
            f"{name} engine not installed (missing module {exc.name!r}); "
            f"install the extra (pip install 'switchyard[{name if name == 'torch' else 'dispatcher'}]') "
            f"or set dispatcher.engine / SWITCHYARD_ENGINE to 'sim'"
        ) from None
    return getattr(module, class_name)(config)
