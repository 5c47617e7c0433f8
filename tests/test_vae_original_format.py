"""Loading a VAE checkpoint with the original Wan2.1 key names (`Wan2.1_VAE.pth`).

sdvg delegates the renaming to diffusers' `convert_wan_vae_to_diffusers`. To write a tiny
checkpoint in the original format, this test inverts that converter: its fixed tables are read
from its source with `ast`, the block renumbering is inverted by rule, and the result is checked
by running the converter forward again (it must give back exactly the diffusers keys)."""
import ast
import inspect
import re

import pytest
import torch

from sdvg.config import VAEConfig
from sdvg.models.vae import StreamingVAEDecoder, build_vae, load_vae_weights

# The converter hard-codes the real Wan2.1 VAE layout (2 residual blocks per resolution level); keep it, small.
REAL_LAYOUT_SMALL = VAEConfig(base_dim=8, num_res_blocks=2)
_RES = {"norm1.gamma": "residual.0.gamma", "conv1": "residual.2", "norm2.gamma": "residual.3.gamma",
        "conv2": "residual.6", "conv_shortcut": "shortcut"}


def _converter_tables():
    from diffusers.loaders import single_file_utils as sfu

    tree = ast.parse(inspect.getsource(sfu.convert_wan_vae_to_diffusers))
    tables = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) and len(node.targets) == 1:
            tables.update(ast.literal_eval(node.value))
    return {v: k for k, v in tables.items()}  # diffusers -> original


def _to_original(key: str, fixed: dict) -> str:
    if key in fixed:
        return fixed[key]
    for stem in ("encoder", "decoder"):
        if key.startswith(f"{stem}.conv_in."):
            return key.replace(f"{stem}.conv_in.", f"{stem}.conv1.")
    m = re.match(r"encoder\.down_blocks\.(\d+)\.(.+)$", key)
    if m:
        rest = m.group(2)
        for new, old in _RES.items():
            if rest.startswith(new + ".") or rest == new:
                rest = old + rest[len(new):]
                break
        return f"encoder.downsamples.{m.group(1)}.{rest}"
    m = re.match(r"decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)$", key)
    if m:
        i, r, rest = int(m.group(1)), int(m.group(2)), m.group(3)
        for new, old in _RES.items():
            if rest.startswith(new + "."):
                return f"decoder.upsamples.{4 * i + r}.{old}{rest[len(new):]}"
    m = re.match(r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.(.+)$", key)
    if m:
        return f"decoder.upsamples.{4 * int(m.group(1)) + 3}.{m.group(2)}"
    return key


def test_original_wan_vae_keys_load(tmp_path):
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    torch.manual_seed(0)
    src = build_vae(REAL_LAYOUT_SMALL)
    fixed = _converter_tables()
    state = src.state_dict()
    original = {_to_original(k, fixed): v.clone() for k, v in state.items()}
    assert any(k.startswith("decoder.upsamples.") for k in original)
    assert set(convert_wan_vae_to_diffusers(dict(original))) == set(state)  # the inverse is exact
    torch.save(original, tmp_path / "Wan2.1_VAE.pth")

    dst = build_vae(REAL_LAYOUT_SMALL)
    load_vae_weights(dst, tmp_path / "Wan2.1_VAE.pth")
    lat = torch.randn(1, 16, 3, 4, 4)
    a, b = StreamingVAEDecoder(src), StreamingVAEDecoder(dst)
    assert torch.equal(a.decode(lat, a.new_cache()), b.decode(lat, b.new_cache()))

    original.pop(next(k for k in original if k.startswith("decoder.")))
    torch.save(original, tmp_path / "partial.pth")
    from sdvg.models.checkpoints import CheckpointError

    with pytest.raises(CheckpointError, match="missing key"):
        load_vae_weights(build_vae(REAL_LAYOUT_SMALL), tmp_path / "partial.pth")
