import torch

from sdvg.generation.transfer import LatentTransfer


def test_same_device_and_cpu_transfers_are_plain():
    t = LatentTransfer([torch.device("cpu")])
    x = torch.randn(2, 3)
    t.prefetch(x, "cpu")
    assert t.get(x, "cpu") is x and not t._copies
    t.release(x)
    t.release(None)
