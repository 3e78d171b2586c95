"""The S2S model (config, weights, forward over pages), sampling, and the serving engine."""

from s2s.batch import PagedBatch
from s2s.config import EngineConfig, ModelConfig
from s2s.engine import Engine, EngineSnapshot, Refused
from s2s.events import AudioEvent, CodesEvent, MetaEvent
from s2s.model import S2SModel, StepOutput
from s2s.placement import placement
from s2s.sampling import SamplingParams, sample

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
