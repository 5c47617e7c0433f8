"""A seed is one model on every device: a random-weight DiT is drawn with the CPU generator and moved to its
device submodule by submodule as it is built (`sdvg.models.components._draw_on_host`), so that the values do not
depend on the device and the model is never whole on the host. Checked on the meta device: each tensor, cloned
at the moment it is moved, equals bitwise the plain CPU construction of the same seed; the host holds at most
about one transformer block at a time. `random_init="device"` is the explicit opt-out."""
import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from sdvg.config import ConfigError, DiTConfig, get_preset
from sdvg.models import components
from sdvg.models.components import _construct, build_random
from sdvg.models.fingerprint import random_fingerprint

TINY = get_preset("tiny")
MID = DiTConfig(dim=256, ffn_dim=512, num_heads=4, num_layers=4, text_dim=64)  # 4 blocks of ~3 MB in fp32
CONFIGS = {"tiny-drafter": (TINY.drafter, torch.float32), "tiny-target": (TINY.target, torch.float32),
           "mid": (MID, torch.float32), "mid-bf16": (MID, torch.bfloat16)}


class Snapshots:
    """A `move_module` that clones each CPU tensor at the moment it is moved: (module id, name) -> clone."""

    def __init__(self):
        self.taken: dict[tuple[int, str], torch.Tensor] = {}

    def __call__(self, module, device):
        for m in module.modules():
            for name, t in [*m._parameters.items(), *m._buffers.items()]:
                if t is not None and t.device.type == "cpu":
                    self.taken[(id(m), name)] = t.detach().clone()
        torch.nn.Module.to(module, device)  # what move_module does

    def differences(self, model, plain) -> list[str]:
        """Tensors of `model` (built through this mover) whose snapshot is missing or differs from `plain`'s."""
        bad = []
        for path, m in model.named_modules():
            want = plain.get_submodule(path)
            for name in [*m._parameters, *m._buffers]:
                if getattr(m, name) is None:
                    continue
                snap, ref = self.taken.get((id(m), name)), getattr(want, name)
                if snap is None:
                    bad.append(f"{path}.{name}: never moved through the mover")
                elif snap.dtype != ref.dtype or not torch.equal(snap, ref):
                    bad.append(f"{path}.{name}: differs from the CPU construction")
        return bad


def on_cpu(model) -> list[str]:
    """Parameters and buffers of `model` still on the CPU."""
    return [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "cpu"]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_values_are_final_when_moved(name):
    cfg, dtype = CONFIGS[name]
    snaps = Snapshots()
    torch.manual_seed(7)
    model = components._draw_on_host(cfg, torch.device("meta"), dtype, move=snaps)
    torch.manual_seed(7)
    plain = _construct(cfg, torch.device("cpu"), dtype)
    assert not on_cpu(model)
    assert not snaps.differences(model, plain), snaps.differences(model, plain)[:8]


def test_the_drawn_model_does_not_depend_on_the_device(monkeypatch):
    """build_random for meta through the real path: each DiT tensor, as it was moved, is the CPU build's."""
    cpu = build_random(TINY, seed=3, need_reward=False)
    snaps = Snapshots()
    monkeypatch.setattr(components, "move_module", snaps, raising=False)
    meta = build_random(TINY, seed=3, drafter_device="meta", need_reward=False)
    for role in ("drafter", "target"):
        model, ref = getattr(meta, role), getattr(cpu, role)
        assert not on_cpu(model), f"{role}: {on_cpu(model)[:4]} left on the CPU"
        diff = snaps.differences(model, ref)
        assert not diff, f"{role}: the weights drawn for meta are not the CPU build's: {diff[:6]}"


def test_cpu_build_is_the_plain_construction():
    """The CPU weights of a seed are what they always were: CausalWanDiT(cfg) after torch.manual_seed(seed + 1/2)."""
    comps = build_random(TINY, seed=5, need_reward=False)
    for role, offset in (("drafter", 1), ("target", 2)):
        torch.manual_seed(5 + offset)
        plain = _construct(getattr(TINY, role), torch.device("cpu"), torch.float32)
        got = getattr(comps, role).state_dict()
        assert all(torch.equal(got[k], v) for k, v in plain.state_dict().items()), role


class HostBytes(TorchDispatchMode):
    """The most bytes of CPU tensor storage alive at once while the mode is on (each storage an op makes on the
    CPU, held weakly: it counts until it is freed)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                self.live[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def nbytes(module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def test_host_holds_at_most_one_block():
    with HostBytes() as drawn:
        model = components._draw_on_host(MID, torch.device("meta"), torch.float32)
    with HostBytes() as plain:  # the measurement sees a whole model built on the CPU
        whole = _construct(MID, torch.device("cpu"), torch.float32)
    block = nbytes(model.model.blocks[0])
    assert plain.peak >= nbytes(whole) > 3 * block
    # one block, and the RoPE table the DiT keeps on the host by design
    assert drawn.peak <= block + model.angle_table.nbytes, (drawn.peak, block, nbytes(whole))


def test_device_init_draws_on_the_device(monkeypatch):
    """random_init="device" constructs each DiT directly on its device: nothing drawn on the host nor moved."""
    monkeypatch.setattr(components, "move_module", lambda *a: pytest.fail("device init moved a module"))
    comps = build_random(TINY, seed=3, drafter_device="meta", need_reward=False, random_init="device")
    assert not on_cpu(comps.drafter) and not on_cpu(comps.target)


def test_random_init_is_checked_and_fingerprinted():
    with pytest.raises(ConfigError) as e:
        build_random(TINY, random_init="gpu")
    assert all(s in str(e.value) for s in ("'gpu'", "('cpu', 'device')")), e.value
    with pytest.raises(ConfigError, match="random_init"):
        random_fingerprint("tiny", 0, "gpu")
    assert random_fingerprint("tiny", 3) == random_fingerprint("tiny", 3, "cpu") == "random:tiny:seed=3"
    assert random_fingerprint("tiny", 3, "device") == "random:tiny:seed=3:init=device"

