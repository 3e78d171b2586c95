"""The S2S model (config, weights, forward over pages), sampling, and the serving engine.

Names are imported on first use (PEP 562): a process that only moves audio and events (a front end) takes
`SamplingParams` or `MetaEvent` from here without importing the model, the codec and transformers behind `Engine`."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_HOMES = {
    "PagedBatch": "s2s.runner.batch",
    "EngineConfig": "s2s.engine.config",
    "ModelConfig": "s2s.models.config",
    "Engine": "s2s.engine.engine",
    "AudioEvent": "s2s.engine.events",
    "CodesEvent": "s2s.engine.events",
    "MetaEvent": "s2s.engine.events",
    "EngineSnapshot": "s2s.engine.metrics",
    "S2SModel": "s2s.models.model",
    "StepOutput": "s2s.models.paged_step",
    "Refused": "s2s.engine.registry",
    "SamplingParams": "s2s.runner.sampling",
    "sample": "s2s.runner.sampling",
    "placement": "s2s.runner.placement",
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
    from s2s.engine.config import EngineConfig
    from s2s.engine.engine import Engine
    from s2s.engine.events import AudioEvent, CodesEvent, MetaEvent
    from s2s.engine.metrics import EngineSnapshot
    from s2s.engine.registry import Refused
    from s2s.models.config import ModelConfig
    from s2s.models.model import S2SModel
    from s2s.models.paged_step import StepOutput
    from s2s.runner.batch import PagedBatch
    from s2s.runner.placement import placement
    from s2s.runner.sampling import SamplingParams, sample


def __getattr__(name: str) -> object:
    if name not in _HOMES:
        raise AttributeError(f"module 's2s' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
