import torch

from sdvg.generation.noise import block_noise, derive_seed, gaussian
from sdvg.generation.schedule import FlowSchedule, warp_timestep


def test_warped_timesteps():
    s = FlowSchedule.from_base((1000, 750, 500, 250), 5.0)
    assert [round(t, 1) for t in s.timesteps] == [1000.0, 937.5, 833.3, 625.0]
    assert warp_timestep(1000, 5.0) == 1000.0


def test_x0_and_renoise():
    s = FlowSchedule.from_base()
    noise, x0 = torch.randn(4), torch.randn(4)
    sigma = s.sigma(1)
    x_t = (1 - sigma) * x0 + sigma * noise
    v = noise - x0
    assert torch.allclose(s.to_x0(x_t, v, 1), x0, atol=1e-6)
    assert torch.allclose(s.renoise(x0, noise, 1), x_t)


def test_noise_streams_are_independent_and_reproducible():
    a = block_noise((2, 3), seed=1, block=2)
    assert torch.equal(a, block_noise((2, 3), seed=1, block=2))
    assert not torch.equal(a, block_noise((2, 3), seed=2, block=2))
    assert not torch.equal(a, block_noise((2, 3), seed=1, block=3))
    assert not torch.equal(gaussian((2, 3), 1, 2, 1, "drafter"), gaussian((2, 3), 1, 2, 1, "target"))
    assert len({derive_seed(0, b, s, r) for b in range(5) for s in range(4) for r in ("init", "drafter")}) == 40
