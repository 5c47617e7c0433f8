"""LatentTransfer on the CPU: same-device requests are the tensor itself, other devices get a plain
exact copy; nothing is kept in flight. The copy-stream path is tested on GPUs (tests/test_gpu.py)."""
import torch

from sdvg.generation.transfer import LatentTransfer


def test_same_device_is_the_tensor_itself():
    t = LatentTransfer([torch.device("cpu")])
    x = torch.randn(2, 3)
    t.prefetch(x, "cpu")
    assert t.get(x, "cpu") is x and t.in_flight() == 0
    t.release(x)
    t.release(None)


def test_other_device_without_prefetch_is_a_plain_copy():
    t = LatentTransfer([torch.device("cpu"), torch.device("meta")])
    x = torch.randn(1, 16, 3, 4, 4, dtype=torch.bfloat16)
    t.prefetch(x, "meta")  # no copy stream for a non-CUDA source: nothing is queued
    y = t.get(x, "meta")
    assert y.device.type == "meta" and y.shape == x.shape and y.dtype == x.dtype
    assert t.in_flight() == 0
