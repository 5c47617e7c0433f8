"""Every tensor a model or an engine module reads moves with `.to()`: each component and each engine
module, moved to the meta device, keeps no tensor on the CPU (its parameters, its buffers and the tensors
its modules hold as plain attributes), and holds no plain tensor attribute where a buffer belongs, but for
the host-side tables listed in `HOST_SIDE` with their reason."""
import copy

import pytest
import torch

from sdvg.engines.modules import DiTStep, RewardStep, VAEDecodeStep
from sdvg.models.exit_head import ExitHead, ExitHeadConfig

# (class, attribute) -> why that plain tensor attribute stays on the host when its module moves
HOST_SIDE = {
    ("CausalWanDiT", "_angles"): "the float64 RoPE table, read on the host only: `rope` builds each block position's "
                                 "cos/sin from it there once, and device_constants keeps them on the device",
}


def plain_tensors(module: torch.nn.Module) -> list[tuple[str, str, torch.Tensor]]:
    """(class, attribute, tensor) of every tensor `module` or a submodule holds as a plain attribute (not a
    parameter nor a buffer), directly or in a list, tuple or dict."""
    found = []
    for m in module.modules():
        for name, value in vars(m).items():
            if name in ("_parameters", "_buffers", "_modules"):
                continue
            held = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
            found += [(type(m).__name__, name, t) for t in held if isinstance(t, torch.Tensor)]
    return found


def _scorer_model(c):
    c.scorer.to("meta", c.scorer.dtype)
    return c.scorer.model


def _text_model(c):
    c.text_encoder.to("meta")
    return c.text_encoder.model


def _vae_modules(c):
    c.vae.vae.to("meta")  # as pipe.to moves the decoder
    return c.vae.vae


# name -> (components, a fresh copy) -> the module, moved to meta the way the pipeline moves it
MOVED = {
    "drafter": lambda c: c.drafter.to("meta"),
    "target": lambda c: c.target.to("meta"),
    "vae_decoder": _vae_modules,
    "reward": _scorer_model,
    "text_encoder": _text_model,
    "exit_head": lambda c: ExitHead(ExitHeadConfig(c.target.config.dim)).to("meta"),
    "dit_step": lambda c: DiTStep(c.target, frames_per_block=3).to("meta"),
    "vae_decode_step": lambda c: VAEDecodeStep(c.vae, c.vae.num_convs, []).to("meta"),
    "reward_step": lambda c: RewardStep(c.scorer).to("meta"),
}


@pytest.fixture(scope="module")
def components():
    from sdvg.config import get_preset
    from sdvg.models.components import build_random

    return build_random(get_preset("tiny"))


@pytest.mark.parametrize("name", sorted(MOVED))
def test_to_moves_every_tensor(components, name):
    module = MOVED[name](copy.deepcopy(components))
    reachable = ([("parameter", n, t) for n, t in module.named_parameters()]
                 + [("buffer", n, t) for n, t in module.named_buffers()] + plain_tensors(module))
    left = [f"{where}.{n}" for where, n, t in reachable if t.device.type != "meta" and (where, n) not in HOST_SIDE]
    assert not left, (f"{name}: {left} stayed on the CPU after .to('meta'): a forward on another device would mix "
                      "devices; register each as a buffer (register_buffer(..., persistent=False)) so .to() moves it")
    plain = sorted({f"{cls}.{attr}" for cls, attr, _ in plain_tensors(module) if (cls, attr) not in HOST_SIDE})
    assert not plain, (f"{name}: plain tensor attributes {plain} where buffers belong: .to() does not move them; "
                       "register them as buffers, or list them in HOST_SIDE with the reason they stay on the host")


def test_host_side_tables_exist(components):
    """Each HOST_SIDE entry names a plain tensor attribute that is there (a stale entry would hide nothing)."""
    held = {(cls, attr) for make in MOVED.values() for cls, attr, _ in plain_tensors(make(copy.deepcopy(components)))}
    assert set(HOST_SIDE) <= held, f"HOST_SIDE lists {sorted(set(HOST_SIDE) - held)}, which no component holds"


def test_vae_step_takes_the_decoders_device_after_a_move(components):
    """The decoder's modules moved after the StreamingVAEDecoder was made (fast_vae makes its step from such a
    decoder): the step's latent statistics are on the modules' device, and they are the VAE's statistics."""
    decoder = copy.deepcopy(components.vae)
    step = VAEDecodeStep(decoder, decoder.num_convs, [])
    cfg = decoder.vae.config
    assert torch.equal(step.mean, torch.tensor(cfg.latents_mean).view(1, -1, 1, 1, 1))
    assert torch.equal(step.std, torch.tensor(cfg.latents_std).view(1, -1, 1, 1, 1))
    decoder.vae.to("meta")
    step = VAEDecodeStep(decoder, decoder.num_convs, [])
    assert step.mean.device.type == "meta" and step.std.device.type == "meta", (step.mean.device, step.std.device)
