"""The S2S model (config, weights, forward over pages), delay pattern, sampling, and the serving engine."""

from s2s.batch import PagedBatch
from s2s.config import ModelConfig
from s2s.engine import AudioEvent, Engine, EngineConfig, MetaEvent, Refused
from s2s.model import S2SModel, StepOutput
from s2s.placement import placement
from s2s.sampling import SamplingParams, sample

__all__ = [
    "AudioEvent",
    "Engine",
    "EngineConfig",
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
