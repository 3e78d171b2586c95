"""The S2S model (config, weights, forward over pages), sampling, and the serving engine.

Names are imported on first use (PEP 562): a process that only moves audio and events (a front end) takes
`SamplingParams` or `MetaEvent` from here without importing the model, the codec and transformers behind `Engine`."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from s2s.placement import placement  # eager: the function, not its module of the same name, is `s2s.placement`

_HOMES = {
    "PagedBatch": "s2s.batch",
    "EngineConfig": "s2s.config",
    "ModelConfig": "s2s.config",
    "Engine": "s2s.engine",
    "AudioEvent": "s2s.events",
    "CodesEvent": "s2s.events",
    "MetaEvent": "s2s.events",
    "EngineSnapshot": "s2s.metrics",
    "S2SModel": "s2s.model",
    "StepOutput": "s2s.model",
    "Refused": "s2s.registry",
    "SamplingParams": "s2s.sampling",
    "sample": "s2s.sampling",
}

__all__ = [
    "AudioEvent",
    "CodesEvent",
    "Engine",
    "EngineConfig",
    "EngineSnapshot",
    "MetaEvent",
    "ModelConfig",
    "PagedBatch",
    "Refused",
    "S2SModel",
    "SamplingParams",
    "StepOutput",
    "placement",
    "sample",
]

if TYPE_CHECKING:
    from s2s.batch import PagedBatch
    from s2s.config import EngineConfig, ModelConfig
    from s2s.engine import Engine
    from s2s.events import AudioEvent, CodesEvent, MetaEvent
    from s2s.metrics import EngineSnapshot
    from s2s.model import S2SModel, StepOutput
    from s2s.registry import Refused
    from s2s.sampling import SamplingParams, sample


def __getattr__(name: str) -> object:
    if name not in _HOMES:
        raise AttributeError(f"module 's2s' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
