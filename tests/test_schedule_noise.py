import numpy as np
import torch

from sdvg.generation.noise import block_noise, derive_seed, gaussian
from sdvg.generation.schedule import FlowSchedule, flow_table, table_sigma, warp_timestep


def reference_table(shift: float):
    """The reference schedulers' table written out plainly: linspace(1, 0, 1001)[:-1] in float32, shifted."""
    s = torch.linspace(1.0, 0.0, 1001, dtype=torch.float32)[:-1]
    sig = shift * s / (1 + (shift - 1) * s)
    return sig * 1000, sig


def test_self_forcing_schedule_four_steps_then_commit():
    s = FlowSchedule.from_steps((1000, 750, 500, 250), 5.0)
    assert [round(t, 1) for t in s.timesteps] == [1000.0, 937.5, 833.3, 625.0]
    # the table's entries are the analytic shift to float32 rounding
    for t, base in zip(s.timesteps, (1000, 750, 500, 250)):
        assert abs(t - warp_timestep(base, 5.0)) < 1e-4
    assert all(abs(sig - t / 1000) < 1e-7 for sig, t in zip(s.sigmas, s.timesteps))  # float32 table entries


def test_krea_five_call_schedule_sigma_at_zero():
    s = FlowSchedule.from_steps((1000, 750, 500, 250, 0), 5.0)
    assert [round(t, 1) for t in s.timesteps] == [1000.0, 937.5, 833.3, 625.0, 0.0]
    assert s.num_steps == 5
    assert abs(s.sigma(4) - 0.0049801) < 1e-7  # the nearest table entry to t = 0, not 0
    assert s.sigma(0) == 1.0


def test_table_lookup_matches_reference_argmin():
    ts, sig = reference_table(5.0)
    assert torch.equal(torch.tensor(flow_table(5.0)[0]), ts.double())
    for t in (0.0, 1.0, 312.7, 625.0, 833.3333, 937.5, 999.9, 1000.0):
        i = int(torch.argmin((ts.double() - t).abs()))
        assert table_sigma(t, 5.0) == float(sig[i])


def test_x0_and_renoise():
    s = FlowSchedule.from_steps((1000, 750, 500, 250))
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


def test_counted_steps_follow_krea_and_keep_the_default_lists():
    from sdvg.config import get_preset
    from sdvg.generation.schedule import counted_steps

    preset = get_preset("wan2.1")
    assert counted_steps(5, recompute=True) == preset.recompute_timesteps  # Krea's default: its five calls
    assert counted_steps(4, recompute=False) == preset.timesteps  # Self-Forcing's four, then the commit
    assert counted_steps(4, recompute=True) == (1000.0, 666.0, 333.0, 0.0)  # linspace(1000, 0, 4).long()
    assert counted_steps(1, recompute=True) == (1000.0,)
    assert counted_steps(5, recompute=True, strength=0.6) == (600.0, 450.0, 300.0, 150.0, 0.0)
    for bad in (0, -1, True, 2.0):
        try:
            counted_steps(bad, recompute=True)
        except ValueError as exc:
            assert "step count" in str(exc)
        else:
            raise AssertionError(f"{bad!r} was taken")


def test_target_steps_reach_the_target_only_and_the_default_count_is_bitwise(tiny_pipe):
    pipe = tiny_pipe
    kw = dict(num_blocks=1, seed=3, scheduler="reference", mode="target")  # one block shows the step count
    plain = pipe("a red fox", **kw).frames
    assert np.array_equal(pipe("a red fox", target_steps=4, **kw).frames, plain)  # tiny's full target: 4 steps
    five = pipe("a red fox", target_steps=5, **kw)
    assert not np.array_equal(five.frames, plain)
    assert five.stats[0].as_dict()["options"]["target_steps"] == 5
    recompute = dict(kw, num_blocks=2, target_context="recompute")  # block 1 rebuilds its context
    assert np.array_equal(pipe("a red fox", target_steps=5, **recompute).frames, pipe("a red fox", **recompute).frames)
    drafts = dict(kw, mode="draft")  # the drafter keeps its distilled schedule
    assert np.array_equal(pipe("a red fox", target_steps=2, **drafts).frames, pipe("a red fox", **drafts).frames)
