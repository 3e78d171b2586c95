"""s2s/placement.py: `--device` / `--dtype` resolution shared by the server and the benchmarks."""

from __future__ import annotations

import pytest
import torch

from s2s import placement


def test_auto_is_a_gpu_in_bf16_where_there_is_one_else_the_cpu_in_fp32() -> None:
    want = (torch.device("cuda"), torch.bfloat16) if torch.cuda.is_available() else (torch.device("cpu"), torch.float32)
    assert placement("auto", "auto") == want
    assert placement("cpu", "auto") == (torch.device("cpu"), torch.float32)
    assert placement("cpu", "bfloat16") == (torch.device("cpu"), torch.bfloat16)


def test_bad_choices_are_refused_with_a_reason() -> None:
    with pytest.raises(ValueError, match="dtype must be auto or one of"):
        placement("cpu", "int8")
    with pytest.raises(ValueError, match="device 'tpu'"):
        placement("tpu", "auto")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            placement("cuda", "auto")
