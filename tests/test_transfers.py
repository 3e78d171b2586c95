"""s2s/runner/transfers.py: copies that do not wait for the device still deliver each round's values, in order.

On a CUDA machine through pinned buffers and events (`scripts/gpu_check.sh` runs this file there); on a CPU the plain
copies they fall back to.
"""

from __future__ import annotations

import numpy as np
import torch

from s2s.runner.transfers import HostCopy, Staging

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_rounds_of_staged_copies_each_arrive_before_the_work_queued_after_them() -> None:
    """Each round writes the same pinned buffers again (growing one of them) while the device may still be behind:
    what the work queued after a round's copies reads is that round's values."""
    staging, dst = Staging(DEVICE), torch.zeros(64, dtype=torch.long, device=DEVICE)
    seen = []
    for i, n in enumerate((8, 8, 64, 3, 64)):
        src = np.arange(n, dtype=np.int64) + 100 * i
        staging.begin()
        staging.copy("a", dst[:n], src)
        mask = staging.to_device("mask", src % 2 == 0)
        staging.end()
        seen.append((dst[:n] * 2).where(mask, dst[:n]))  # work queued after the copies, on the device
    for i, (n, got) in enumerate(zip((8, 8, 64, 3, 64), seen, strict=True)):
        src = np.arange(n, dtype=np.int64) + 100 * i
        np.testing.assert_array_equal(got.cpu().numpy(), np.where(src % 2 == 0, 2 * src, src))


def test_a_host_copy_is_the_tensor_as_it_was_when_the_copy_started() -> None:
    tensor = torch.arange(6, device=DEVICE).reshape(2, 3)
    copied = HostCopy(tensor)
    later = tensor + 1  # queued after the copy
    np.testing.assert_array_equal(copied.numpy(), np.arange(6).reshape(2, 3))
    assert later.sum().item() == 21
