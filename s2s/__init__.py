"""The S2S model (config, weights, forward over pages), delay pattern and sampling; later the engine."""

from s2s.batch import PagedBatch
from s2s.config import ModelConfig
from s2s.model import S2SModel, StepOutput
from s2s.sampling import SamplingParams, sample

__all__ = ["ModelConfig", "PagedBatch", "S2SModel", "SamplingParams", "StepOutput", "sample"]
