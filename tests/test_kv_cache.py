import pytest
import torch

from sdvg._native import _C
from sdvg.config import KVWindow, get_preset
from sdvg.models.kv_cache import KVCacheSpec, MemoryBudgetError

TPF, H, D, L = 4, 2, 3, 2


def _kv(n_frames, fill):
    k = torch.full((1, H, n_frames * TPF, D), float(fill))
    return k, -k


def _cache(max_frames=12, window=KVWindow()):
    return KVCacheSpec(L, H, D, TPF, max_frames, window).allocate(torch.float32, "cpu")


def test_overwrite_commit_and_visible():
    c = _cache()
    c.begin_write(3)
    c.write(0, *_kv(3, 1))
    c.begin_write(3)  # a second denoising pass overwrites the same slots
    c.write(0, *_kv(3, 2))
    k, v = c.visible(0)
    assert k.shape == (1, H, 3 * TPF, D) and torch.all(k == 2) and torch.all(v == -2)
    c.commit()
    assert c.committed_frames == 3
    c.begin_write(3)
    c.write(0, *_kv(3, 5))
    k, _ = c.visible(0)
    assert k.shape[2] == 6 * TPF
    assert torch.all(k[:, :, : 3 * TPF] == 2) and torch.all(k[:, :, 3 * TPF:] == 5)
    # contiguous visible slots are a view of the buffer, not a copy
    assert k.data_ptr() == c.layer_buffer(0)[0].data_ptr()


def test_rollback_is_pointer_only():
    c = _cache()
    for b in range(3):
        c.begin_write(3)
        c.write(1, *_kv(3, b + 1))
        c.commit()
    before = c.buffer.clone()
    c.rollback(3)
    assert c.committed_frames == 3
    assert torch.equal(c.buffer, before)  # nothing copied or cleared
    c.begin_write(3)
    assert c.visible_frames() == list(range(6))
    with pytest.raises(ValueError) as e:
        c.rollback(7)
    assert all(s in str(e.value) for s in ("7", "committed frames")), e.value


def test_window_with_sink_evicts_oldest_non_sink():
    c = _cache(max_frames=30, window=KVWindow(window_frames=6, sink_frames=1))
    assert c.num_slots == 7
    for b in range(5):
        c.begin_write(3)
        c.write(0, *_kv(3, b + 1))
        c.commit()
    c.begin_write(3)
    c.write(0, *_kv(3, 9))
    assert c.visible_frames() == [0, 12, 13, 14, 15, 16, 17]
    k, _ = c.visible(0)  # gathered in frame order: sink (block 1 value), block 5, block 6
    per_frame = k[0, 0, ::TPF, 0].tolist()
    assert per_frame == [1.0, 5.0, 5.0, 5.0, 9.0, 9.0, 9.0]
    c.commit()
    assert not c.can_rollback(15)
    with pytest.raises(ValueError) as e:
        c.rollback(15)
    assert all(s in str(e.value) for s in ("15", "slack_frames")), e.value


def test_window_slack_rollback_restores_visible_set():
    c = _cache(max_frames=30, window=KVWindow(window_frames=6, sink_frames=1, slack_frames=3))
    for b in range(4):
        c.begin_write(3)
        c.write(0, *_kv(3, b + 1))
        c.commit()
    c.begin_write(3)
    k_before, _ = c.visible(0)
    k_before = k_before.clone()
    c.write(0, *_kv(3, 7))
    c.commit()  # speculative block
    c.rollback(12)
    c.begin_write(3)
    c.write(0, *_kv(3, 5))
    k_after, _ = c.visible(0)
    assert torch.equal(k_after[:, :, :-3 * TPF], k_before[:, :, :-3 * TPF])


def test_write_shape_checked():
    c = _cache()
    c.begin_write(3)
    with pytest.raises(ValueError, match="expects K/V of shape"):
        c.write(0, *_kv(2, 1))
    with pytest.raises(IndexError):
        c.layer_buffer(5)


def test_memory_is_known_before_allocation_and_budget_refused():
    p = get_preset("wan2.1")
    tpf = p.video.tokens_per_frame(p.vae, p.target)
    assert tpf == 1560
    spec = KVCacheSpec.for_dit(p.target, tpf, 27)
    # 40 layers x K,V x 40 heads x 128 x 27 frames x 1560 tokens x 2 bytes ~ 34.5 GB
    assert spec.nbytes(torch.bfloat16) == 40 * 2 * 40 * 128 * 27 * 1560 * 2
    with pytest.raises(MemoryBudgetError, match="GiB"):
        spec.allocate(torch.bfloat16, "cpu", budget_bytes=8 * 2**30)
    windowed = KVCacheSpec.for_dit(p.target, tpf, 27, KVWindow(window_frames=9, sink_frames=3))
    assert windowed.nbytes(torch.bfloat16) == spec.nbytes(torch.bfloat16) * 12 // 27


def test_slot_table_python_view():
    t = _C.FrameSlotTable(_C.SlotLayout(9))
    assert t.write(3) == [0, 1, 2]
    t.commit()
    assert t.committed_frames == 3


def test_write_positions_equal_write_tokens():
    """The sparse write with the positions built once per forward on the device (no host round trip per
    layer) writes what the native `write_tokens` writes, in a wrapped local window too."""
    from sdvg.models.kv_cache import pending_token_positions, write_positions

    spec = KVCacheSpec(num_layers=2, heads=2, head_dim=4, tokens_per_frame=3, max_frames=12,
                       window=KVWindow(window_frames=4, sink_frames=1))
    native, ours = spec.allocate(torch.float32, "cpu"), spec.allocate(torch.float32, "cpu")
    g = torch.Generator().manual_seed(0)
    for block in range(5):
        for cache in (native, ours):
            cache.begin_write(2)
        tokens = torch.tensor(sorted(torch.randperm(6, generator=g)[:4].tolist()))
        positions = pending_token_positions(ours, tokens)
        for layer in range(2):
            k, v = torch.randn(1, 2, 4, 4, generator=g), torch.randn(1, 2, 4, 4, generator=g)
            native.write_tokens(layer, k, v, tokens)
            write_positions(ours, layer, k, v, positions)
        assert torch.equal(native.buffer, ours.buffer), block
        for cache in (native, ours):
            cache.commit()
    with pytest.raises(ValueError, match="token positions"):
        ours.begin_write(2)
        write_positions(ours, 0, torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), positions)
