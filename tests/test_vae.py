import pytest
import torch

from sdvg.config import get_preset
from sdvg.models.vae import StreamingVAEDecoder, build_vae, to_uint8_frames, to_unit_frames


@pytest.fixture(scope="module")
def dec():
    torch.manual_seed(0)
    return StreamingVAEDecoder(build_vae(get_preset("tiny").vae))


def test_streaming_equals_whole_video_decode(dec):
    lat = torch.randn(1, 16, 9, 8, 8)
    cache = dec.new_cache()
    parts = [dec.decode(lat[:, :, i:i + 3], cache) for i in (0, 3, 6)]
    assert [p.shape[2] for p in parts] == [9, 12, 12]
    assert torch.equal(torch.cat(parts, 2), dec.decode_video(lat))


@pytest.mark.parametrize("n", [1, 2, 5])
def test_frame_count_is_1_plus_4k(dec, n):
    assert dec.decode(torch.randn(1, 16, n, 8, 8), dec.new_cache()).shape[2] == 1 + 4 * (n - 1)


def test_draft_restore_target_equals_direct(dec):
    committed = torch.randn(1, 16, 6, 8, 8)
    draft = torch.randn(1, 16, 3, 8, 8)
    cache = dec.new_cache()
    first = dec.decode(committed[:, :, :3], cache)
    snap = cache.snapshot()
    dec.decode(draft, cache)  # a rejected draft
    cache.restore(snap)
    second = dec.decode(committed[:, :, 3:], cache)
    assert torch.equal(torch.cat([first, second], 2), dec.decode_video(committed))


def test_snapshot_copies_no_tensor(dec):
    cache = dec.new_cache()
    dec.decode(torch.randn(1, 16, 3, 8, 8), cache)
    snap = cache.snapshot()
    tensors = [e for e in snap.entries if isinstance(e, torch.Tensor)]
    assert tensors, "the decoder left no cached features"
    # The snapshot holds the very same tensor objects (no copy) ...
    assert all(a is b for a, b in zip(snap.entries, cache.entries))
    values = [t.clone() for t in tensors]
    ptrs = [t.data_ptr() for t in tensors]
    dec.decode(torch.randn(1, 16, 3, 8, 8), cache)
    # ... and the decoder replaced every entry instead of writing into it.
    assert all(a is not b for a, b in zip(snap.entries, cache.entries) if isinstance(a, torch.Tensor))
    assert all(torch.equal(t, v) and t.data_ptr() == p for t, v, p in zip(tensors, values, ptrs))


def test_frame_conversions_and_bad_latents(dec):
    px = torch.tensor([-1.0, 0.0, 1.0]).view(1, 3, 1, 1, 1).expand(1, 3, 2, 2, 2)
    u8 = to_uint8_frames(px)
    assert u8.shape == (2, 2, 2, 3) and u8.dtype == torch.uint8 and u8[0, 0, 0].tolist() == [0, 128, 255]
    assert to_unit_frames(px).shape == (2, 3, 2, 2)
    with pytest.raises(ValueError, match="latents must be"):
        dec.decode(torch.randn(1, 4, 3, 8, 8), dec.new_cache())


def test_vae_checkpoint_strict(tmp_path, dec):
    from safetensors.torch import save_file

    from sdvg.models.checkpoints import CheckpointError
    from sdvg.models.vae import load_vae_weights

    state = {k: v.contiguous() for k, v in dec.vae.state_dict().items()}
    save_file(state, str(tmp_path / "vae.safetensors"))
    fresh = build_vae(get_preset("tiny").vae)
    load_vae_weights(fresh, tmp_path / "vae.safetensors")
    assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in state.items())
    state.pop(next(iter(state)))
    save_file(state, str(tmp_path / "bad.safetensors"))
    with pytest.raises(CheckpointError, match="missing key"):
        load_vae_weights(build_vae(get_preset("tiny").vae), tmp_path / "bad.safetensors")
