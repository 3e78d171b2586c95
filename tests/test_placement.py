"""s2s/runner/placement.py: `--device` / `--dtype` resolution shared by the server and the benchmarks."""

from __future__ import annotations

import pytest
import torch

from s2s import placement


@pytest.mark.parametrize(
    ("gpu", "device", "dtype", "want"),
    [
        (True, "auto", "auto", ("cuda", torch.bfloat16)),
        (False, "auto", "auto", ("cpu", torch.float32)),
        (True, "cpu", "auto", ("cpu", torch.float32)),  # bf16 matmuls on a CPU are slower than fp32
        (False, "cpu", "auto", ("cpu", torch.float32)),
        (True, "cuda", "auto", ("cuda", torch.bfloat16)),
        (True, "cuda:1", "float16", ("cuda:1", torch.float16)),
        (True, "auto", "float32", ("cuda", torch.float32)),
        (False, "cpu", "bfloat16", ("cpu", torch.bfloat16)),
    ],
)
def test_auto_is_a_gpu_in_bf16_where_there_is_one_else_the_cpu_in_fp32(
    monkeypatch, gpu: bool, device: str, dtype: str, want: tuple[str, torch.dtype]
) -> None:
    """Each choice on a machine with a GPU and on one without (torch's answer is set: no GPU is needed to check
    either), against the answer written out."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    assert placement(device, dtype) == (torch.device(want[0]), want[1])


def test_bad_choices_are_refused_with_a_reason() -> None:
    with pytest.raises(ValueError, match="dtype must be auto or one of"):
        placement("cpu", "int8")
    with pytest.raises(ValueError, match="device 'tpu'"):
        placement("tpu", "auto")


def test_a_gpu_asked_for_where_there_is_none_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="no CUDA GPU"):
        placement("cuda", "auto")
