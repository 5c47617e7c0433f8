"""Token-level early exit (Speculative Forcing): the sparse DiT forward against the dense one, the
loop's invariants (frozen outputs and K/V), the verifiers' extremes, exactness when nothing exits,
reference == native, the composition with SDVG, statistics and bad input."""
import math

import pytest
import torch

from sdvg.config import KVWindow
from sdvg.generation.early_exit.oracle import relative_gaps
from sdvg.generation.early_exit.pattern import exit_steps, expected_steps, hazard_for
from sdvg.generation.early_exit.record import ExitRecord
from sdvg.generation.early_exit.tokens import smooth_scores, to_tokens, token_mask_to_latents
from sdvg.models.kv_cache import KVCacheSpec
from sdvg.options import GenerationOptions, OptionError

FPB, GH, GW = 3, 4, 4
TPF = GH * GW
S = FPB * TPF
PROMPT = "a red fox"


def _cache(dit, frames=4 * FPB, window=KVWindow()):
    return KVCacheSpec.for_dit(dit.config, TPF, frames, window).allocate(torch.float32, "cpu")


def _history(dit, text, cache, blocks=2, seed=3):
    g = torch.Generator().manual_seed(seed)
    for _ in range(blocks):
        dit(torch.randn(1, 16, FPB, 2 * GH, 2 * GW, generator=g), torch.zeros(1, FPB), text, cache=cache)
        cache.commit()


# ------------------------------------------------------------------------ the sparse forward
def test_sparse_forward_over_all_tokens_equals_dense(dit, text):
    x = torch.randn(1, 16, FPB, 2 * GH, 2 * GW, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([[937.5, 937.5, 937.5]])
    dense_cache, sparse_cache = _cache(dit), _cache(dit)
    _history(dit, text, dense_cache)
    _history(dit, text, sparse_cache)
    hidden_dense, hidden_sparse = [], []
    dense = dit(x, t, text, cache=dense_cache, hidden=hidden_dense)
    sparse = dit(x, t, text, cache=sparse_cache, active=torch.arange(S), hidden=hidden_sparse)
    assert torch.equal(dense, sparse)  # the same elementwise arithmetic, token for token
    assert torch.equal(hidden_dense[0], hidden_sparse[0])
    assert torch.equal(dense_cache.buffer, sparse_cache.buffer)


def test_sparse_forward_over_a_subset_equals_the_dense_rows(dit, text):
    x = torch.randn(1, 16, FPB, 2 * GH, 2 * GW, generator=torch.Generator().manual_seed(1))
    t = torch.full((1, FPB), 833.3)
    cache = _cache(dit)
    _history(dit, text, cache)
    dense = dit(x, t, text, cache=cache)  # writes every token's K/V into the pending slot
    before = cache.buffer.clone()
    active = torch.tensor([0, 5, 17, 18, 31, 40, 47])
    sparse = dit(x, t, text, cache=cache, active=active)  # the others' K/V are the dense pass's
    mask = token_mask_to_latents(torch.isin(torch.arange(S), active), tuple(x.shape), (1, 2, 2)).expand_as(x)
    # fp32, attention over the same keys; the reduction order differs between the two shapes (1.05e-5 seen
    # with one thread, below 1e-5 with two)
    assert (sparse[mask] - dense[mask]).abs().max() < 2e-5
    assert torch.equal(sparse[~mask], torch.zeros_like(sparse[~mask]))  # not computed: zero
    assert (cache.buffer - before).abs().max() < 1e-5  # the active rows rewritten with the same K/V


def test_sparse_forward_writes_only_the_active_tokens_kv(dit, text):
    cache = _cache(dit)
    _history(dit, text, cache)
    g = torch.Generator().manual_seed(2)
    dit(torch.randn(1, 16, FPB, 2 * GH, 2 * GW, generator=g), torch.full((1, FPB), 1000.0), text, cache=cache)
    before = cache.buffer.clone()
    active = torch.tensor([1, 2, 30])
    dit(torch.randn(1, 16, FPB, 2 * GH, 2 * GW, generator=g), torch.full((1, FPB), 625.0), text, cache=cache,
        active=active)
    slot0 = 2 * FPB * TPF  # the pending block follows two committed blocks
    changed = (cache.buffer != before).any(dim=(0, 1, 2, 3, 5)).nonzero().flatten()  # token rows that moved
    assert set(changed.tolist()) == {slot0 + 1, slot0 + 2, slot0 + 30}


@pytest.mark.parametrize("active,match", [
    (torch.tensor([3, 1]), "strictly ascending"),
    (torch.tensor([0, S]), "strictly ascending within"),
    (torch.tensor([], dtype=torch.long), "at least one active token"),
    (torch.tensor([0.0, 1.0]), "1-D int64"),
])
def test_bad_active_sets_are_refused(dit, text, active, match):
    x = torch.randn(1, 16, FPB, 2 * GH, 2 * GW)
    with pytest.raises(ValueError, match=match):
        dit(x, torch.zeros(1, FPB), text, cache=_cache(dit), active=active)


def test_sparse_forward_needs_a_cache(dit, text):
    with pytest.raises(ValueError, match="needs a cache"):
        dit(torch.randn(1, 16, FPB, 2 * GH, 2 * GW), torch.zeros(1, FPB), text, active=torch.arange(3))


# ------------------------------------------------------------------------- token helpers
def test_token_layout_matches_the_dit_sequence(dit):
    x = torch.randn(1, 16, FPB, 2 * GH, 2 * GW)
    tokens = to_tokens(x, (1, 2, 2))  # [S, 64]
    assert tokens.shape == (S, 64)
    # token 1 of frame 2 is row 0, column 1: latents [2, 0:2, 2:4]
    assert torch.equal(tokens[2 * TPF + 1].reshape(16, 2, 2), x[0, :, 2, 0:2, 2:4])
    mask = torch.zeros(S, dtype=torch.bool)
    mask[2 * TPF + 1] = True
    lat = token_mask_to_latents(mask, tuple(x.shape), (1, 2, 2))
    assert lat.sum() == 4 and bool(lat[0, 0, 2, 0:2, 2:4].all())


def test_smoothing_keeps_constants_and_spreads_a_peak():
    flat = torch.full((3, 5, 6), 0.7)
    assert (smooth_scores(flat) - 0.7).abs().max() < 1e-6
    peak = torch.zeros(3, 9, 9)
    peak[1, 4, 4] = 1.0
    out = smooth_scores(peak)
    assert abs(float(out.sum()) - 1.0) < 1e-5 and out[1, 4, 4] < 1.0 and out[1, 4, 5] > 0 and out[0, 4, 4] > 0
    assert out[1, 4, 5] == out[1, 5, 4] == out[1, 3, 4]  # isotropic in space


def test_pattern_hits_its_mean_and_is_seeded():
    for mean in (1.0, 1.65, 2.5, 4.0):
        q = hazard_for(mean, 4)
        assert abs(expected_steps(q, 4) - mean) < 1e-9
        steps = exit_steps(20000, 4, mean, torch.Generator().manual_seed(0))
        assert abs(float(steps.float().mean()) - mean) < 2e-3
    a = exit_steps(100, 4, 1.65, torch.Generator().manual_seed(1))
    assert torch.equal(a, exit_steps(100, 4, 1.65, torch.Generator().manual_seed(1)))
    assert not torch.equal(a, exit_steps(100, 4, 1.65, torch.Generator().manual_seed(2)))


def test_relative_gaps_of_a_rollout():
    final = torch.randn(1, 16, 3, 8, 8)
    x0s = [final + 1.0, final * 0 + final, final]
    gaps = relative_gaps(x0s, (1, 2, 2))
    sigma = to_tokens(final, (1, 2, 2)).norm(dim=1).median()
    assert torch.allclose(gaps[0], torch.full_like(gaps[0], 8.0 / sigma))  # ||1||_2 over 64 values = 8
    assert torch.equal(gaps[2], torch.zeros_like(gaps[2]))


def test_exit_record_statistics():
    steps = torch.tensor([[[1, 1], [2, 4]]], dtype=torch.int16)
    r = ExitRecord("target", 3, "pattern", 4, steps, forwards=4)
    assert r.mean_steps == 2.0 and r.max_steps == 4 and r.token_evals == 8
    assert r.exit_fractions() == [0.5, 0.25, 0.0, 0.25]


# ------------------------------------------------------------------------------- the loop
def _latents(pipe, **kw):
    return pipe(PROMPT, output_type="latent", **kw)


@pytest.mark.parametrize("scheduler,never", [
    ("reference", dict(exit_verifier="stability", exit_thresholds=(0.0, 0.0))),
    ("cpp", dict(exit_verifier="oracle", exit_eps=0.0)),
])
def test_nothing_exiting_reproduces_the_plain_loop_bitwise(tiny_pipe, scheduler, never):
    kw = dict(num_blocks=2, seed=5, router="pattern", pattern="01", scheduler=scheduler)
    plain = _latents(tiny_pipe, **kw)
    exit_ = _latents(tiny_pipe, early_exit="both", **never, **kw)
    assert torch.equal(plain.latents, exit_.latents)
    assert exit_.stats["result"]["mean_steps"] == 4.0 and exit_.stats["result"]["max_steps"] == 4


def test_oracle_with_a_large_eps_exits_every_token_at_step_one(tiny_pipe):
    out = _latents(tiny_pipe, mode="target", num_blocks=2, seed=1, early_exit="target", exit_verifier="oracle",
                   exit_eps=100.0)  # the bound (sdvg.options.MAX_EXIT_EPS); tiny exits everything from ~3
    assert out.stats["result"]["mean_steps"] == 1.0 and out.stats["result"]["max_steps"] == 1
    for b in out.stats["blocks"]:
        rec = b["exit"]["target"]
        assert rec["exit_fractions"] == [1.0, 0.0, 0.0, 0.0] and rec["forwards"] == 1 and rec["oracle_forwards"] == 4
    assert out.stats["result"]["exit_roles"]["target"]["forwards"] == 2


class _Spy:
    """Wraps a RoleModel's forward: records each call's inputs, output and the cache after it."""

    def __init__(self, model):
        self.model, self.calls = model, []
        self._forward = model.forward
        model.forward = self

    def __call__(self, x, t, frame0, text_kv, attn_mask=None, active=None, hidden=None):
        flow = self._forward(x, t, frame0, text_kv, attn_mask=attn_mask, active=active, hidden=hidden)
        self.calls.append(dict(x=x.clone(), t=float(t[0, 0]), flow=flow.clone(), active=active,
                               kv=self.model.cache.buffer.clone()))
        return flow


def test_frozen_tokens_keep_their_step_output_and_kv(tiny_pipe):
    from sdvg.generation.early_exit import ExitPlan, make_verifier
    from sdvg.generation.prepare import prepare
    from sdvg.generation.types import Counters

    opts = GenerationOptions(mode="target", num_blocks=2, seed=3, early_exit="target",
                             exit_verifier="pattern").resolved(tiny_pipe.preset)
    setup = prepare(tiny_pipe.components, PROMPT, opts, Counters())
    target = setup.target
    text_kv = setup.text_kv[setup.conditioning.key, "target"]
    x0 = target.denoise(torch.randn(setup.block_shape), 0, 0, opts.seed, text_kv)
    target.commit_forward(x0, 0, text_kv)
    target.cache.commit()  # the loop moves the write pointer (RoleModel only runs the forward)
    spy = _Spy(target)
    out = target.denoise(torch.randn(setup.block_shape, generator=torch.Generator().manual_seed(9)), 1, FPB,
                         opts.seed, text_kv)
    steps = target.exit_records[1].steps.flatten()  # k* per token
    assert 1 <= int(steps.min()) and int(steps.max()) == 4 and len(spy.calls) == int(steps.max())
    sched, shape = target.schedule, tuple(out.shape)
    slot0 = FPB * TPF
    for i, call in enumerate(spy.calls):
        x0_i = sched.to_x0(call["x"], call["flow"], i)
        leaving = steps == i + 1
        mask = token_mask_to_latents(leaving, shape, (1, 2, 2)).expand(shape)
        assert torch.equal(out[mask], x0_i[mask])  # committed at x0_hat^(k)
        computed = torch.arange(S) if call["active"] is None else call["active"]
        assert set(computed.tolist()) == set((steps > i).nonzero().flatten().tolist()) | set(
            (steps == i + 1).nonzero().flatten().tolist())  # the active set: tokens not yet exited
        for later in spy.calls[i + 1:]:  # frozen K/V rows stay until the block's clean forward
            rows = slot0 + (steps <= i + 1).nonzero().flatten()
            assert torch.equal(later["kv"][..., rows, :], call["kv"][..., rows, :])
    assert target.exit_records[1].forwards == len(spy.calls)


@pytest.mark.parametrize("context", ["full", pytest.param("recompute", marks=pytest.mark.slow)])
def test_reference_and_native_agree_bitwise(tiny_pipe, context):
    kw = dict(num_blocks=3, seed=2, router="pattern", pattern="011", early_exit="both", exit_verifier="pattern",
              target_context=context, drafter_cache=context, keep_first_frame=True)
    ref = _latents(tiny_pipe, scheduler="reference", **kw)
    for run_ahead in (False, True):
        nat = _latents(tiny_pipe, scheduler="cpp", run_ahead=run_ahead, **kw)
        assert torch.equal(ref.latents, nat.latents), run_ahead
        assert [b["exit"] for b in ref.stats["blocks"]] == [b["exit"] for b in nat.stats["blocks"]]
    assert 1.0 < ref.stats["result"]["mean_steps"] < (4.0 if context == "full" else 5.0)
    assert ref.stats["result"]["max_steps"] == (4 if context == "full" else 5)


@pytest.mark.slow
def test_stability_verifier_exits_on_redundant_tokens(tiny_pipe):
    """With generous thresholds the training-free verifier exits tokens, from block 1 (block 0 has no
    history at its first step), and the video stays finite and deterministic."""
    kw = dict(mode="target", num_blocks=3, seed=4, early_exit="target", exit_verifier="stability",
              exit_thresholds=(1e6, 1e6))
    a, b = _latents(tiny_pipe, **kw), _latents(tiny_pipe, **kw)
    assert torch.equal(a.latents, b.latents) and bool(torch.isfinite(a.latents).all())
    blocks = a.stats["blocks"]
    assert blocks[0]["exit"]["target"]["exit_fractions"][0] == 0.0  # no history at block 0, step 1
    assert blocks[0]["exit"]["target"]["exit_fractions"][1] == 1.0  # then stable: all leave at step 2
    assert blocks[1]["exit"]["target"]["exit_fractions"][0] == 1.0  # redundant with the history


@pytest.mark.slow
def test_sdvg_at_tau_inf_equals_target_only_with_early_exit(tiny_pipe):
    kw = dict(num_blocks=2, seed=6, early_exit="both", exit_verifier="pattern")
    sdvg = _latents(tiny_pipe, mode="sdvg", tau=math.inf, **kw)
    target = _latents(tiny_pipe, mode="target", **{**kw, "early_exit": "target"})
    assert torch.equal(sdvg.latents, target.latents)
    assert [b["decision"] for b in sdvg.stats["blocks"]] == ["forced", "rejected"]
    assert sdvg.stats["result"]["mean_steps"] == target.stats["result"]["mean_steps"]


@pytest.mark.slow
def test_drafter_exit_changes_drafts_not_the_target(tiny_pipe):
    kw = dict(num_blocks=3, seed=7, router="pattern", pattern="1")
    plain = _latents(tiny_pipe, **kw)
    drafter_exit = _latents(tiny_pipe, early_exit="drafter", exit_verifier="pattern", **kw)
    assert torch.equal(plain.latents[:, :, :FPB], drafter_exit.latents[:, :, :FPB])  # block 0: the target's
    assert not torch.equal(plain.latents[:, :, FPB:], drafter_exit.latents[:, :, FPB:])  # accepted drafts
    blocks = drafter_exit.stats["blocks"]
    assert blocks[0]["exit"]["producer"] == "target" and blocks[0]["mean_steps"] == 4.0  # no target exit
    assert blocks[1]["exit"]["producer"] == "drafter" and blocks[1]["mean_steps"] < 4.0


# ----------------------------------------------------------------------------- bad input
def test_static_backends_refuse_early_exit_before_generating(tiny_pipe):
    with pytest.raises(OptionError, match="only the eager backend runs"):
        tiny_pipe(PROMPT, num_blocks=1, early_exit="target", backend="compile")


def test_a_head_for_another_width_is_refused(tiny_pipe, tmp_path):
    from sdvg.models.exit_head import ExitHead, ExitHeadConfig

    path = tmp_path / "head.safetensors"
    ExitHead(ExitHeadConfig(dim=tiny_pipe.components.target.config.dim + 8)).save(path)
    with pytest.raises(ValueError) as e:
        tiny_pipe(PROMPT, mode="target", num_blocks=1, early_exit="target", exit_verifier="head", exit_head=str(path))
    assert all(s in str(e.value) for s in (str(tiny_pipe.components.target.config.dim + 8), "width")), e.value
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError) as e:
        tiny_pipe(PROMPT, mode="target", num_blocks=1, early_exit="target", exit_verifier="head",
                  exit_head=str(tmp_path / "junk.safetensors"))
    assert all(s in str(e.value) for s in ("junk.safetensors", "not a readable safetensors")), e.value
    with pytest.raises(FileNotFoundError) as e:
        tiny_pipe(PROMPT, mode="target", num_blocks=1, early_exit="target", exit_verifier="head",
                  exit_head=str(tmp_path / "missing.safetensors"))
    assert all(s in str(e.value) for s in ("missing.safetensors", "train-exit-head")), e.value


def test_a_head_of_the_right_width_runs(tiny_pipe, tmp_path):
    from sdvg.models.exit_head import ExitHead, ExitHeadConfig

    dim = tiny_pipe.components.target.config.dim
    head = ExitHead(ExitHeadConfig(dim=dim))
    torch.nn.init.constant_(head.out.bias, -1.0)  # predicts a negative gap everywhere: every token exits
    torch.nn.init.zeros_(head.out.weight)
    path = tmp_path / "head.safetensors"
    head.save(path, extra={"note": "test"})
    assert ExitHead.read_extra(path) == {"note": "test"}
    out = _latents(tiny_pipe, mode="target", num_blocks=2, seed=1, early_exit="target", exit_verifier="head",
                   exit_head=str(path))
    assert out.stats["result"]["mean_steps"] == 1.0


def test_head_parameter_count_at_the_papers_width():
    from sdvg.models.exit_head import ExitHead, ExitHeadConfig

    n = ExitHead(ExitHeadConfig(dim=1536)).num_parameters
    assert 4.0e6 < n < 4.2e6  # "about 4.1M parameters at dim 1536"


def test_cli_writes_the_exit_map_and_the_stats(tmp_path):
    import json

    from sdvg import cli

    png, stats = tmp_path / "exits.png", tmp_path / "s.json"
    assert cli.main(["generate", "--prompt", PROMPT, "--num-blocks", "2", "--mode", "target", "--early-exit", "target",
                     "--exit-verifier", "pattern", "--exit-pattern-steps", "2", "--quiet", "--out",
                     str(tmp_path / "v.mp4"), "--stats", str(stats), "--exit-map", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(stats.read_text())
    assert data["options"]["early_exit"] == "target" and abs(data["result"]["mean_steps"] - 2.0) < 0.2
    with pytest.raises(SystemExit) as bad:  # argparse: exit status 2 with the option's message
        cli.main(["generate", "--prompt", PROMPT, "--num-blocks", "1", "--early-exit", "target",
                  "--exit-thresholds", "0.5,-1", "--quiet", "--out", str(tmp_path / "w.mp4")])
    assert bad.value.code == 2 and not (tmp_path / "w.mp4").exists()


@pytest.mark.slow
def test_stability_history_is_what_the_window_sees(tiny_pipe):
    """Under a windowed full context the redundancy history is the visible committed frames (sink and
    window), the very latents committed, and frames out of reach are forgotten."""
    from sdvg.generation.prepare import prepare
    from sdvg.generation.types import Counters

    opts = GenerationOptions(mode="target", num_blocks=7, seed=3, early_exit="target", window_frames=6,
                             sink_frames=1).resolved(tiny_pipe.preset)
    setup = prepare(tiny_pipe.components, PROMPT, opts, Counters())
    target = setup.target
    text_kv = setup.text_kv[setup.conditioning.key, "target"]
    committed = []
    for b in range(6):
        x = target.denoise(torch.randn(setup.block_shape, generator=torch.Generator().manual_seed(b)), b, b * FPB,
                           opts.seed, text_kv)
        target.commit_forward(x, b * FPB, text_kv)
        target.cache.commit()
        committed.append(x)
    frames = target.history_frames()
    video = torch.cat(committed, dim=2)  # [1, C, 18, h, w]
    want = [f for f in target.cache.visible_frames() if f < 18]  # the committed frames the next block sees
    assert want[0] == 0 and 1 not in want and 17 in want  # the sink, a gap, the recent window
    assert len(frames) == len(want)
    for f, got in zip(want, frames):
        assert torch.equal(got, video[:, :, f:f + 1])
    assert all(f == 0 or f >= 18 - 6 - 2 * FPB for f in target.kept_clean_frames)  # the rest forgotten
    assert 1 not in target.kept_clean_frames
    assert target.history_tokens(frames).shape == (len(want) * TPF, 64)


def test_a_head_trained_for_the_other_role_is_refused(tiny_pipe, tmp_path):
    from sdvg.models.exit_head import ExitHead, ExitHeadConfig

    path = tmp_path / "drafter_head.safetensors"
    ExitHead(ExitHeadConfig(dim=tiny_pipe.components.target.config.dim)).save(path, extra={"generator": {"role":
                                                                                                         "drafter"}})
    with pytest.raises(ValueError) as e:
        tiny_pipe(PROMPT, mode="target", num_blocks=1, early_exit="target", exit_verifier="head", exit_head=str(path))
    assert "drafter" in str(e.value)


def test_the_pattern_mean_cannot_exceed_the_schedule(tiny_pipe):
    with pytest.raises(OptionError, match=r"exceeds the target's 4 denoising steps"):
        tiny_pipe(PROMPT, mode="target", num_blocks=1, early_exit="target", exit_verifier="pattern",
                  exit_pattern_steps=4.5)
    out = _latents(tiny_pipe, mode="target", num_blocks=1, early_exit="target", exit_verifier="pattern",
                   exit_pattern_steps=4.5, target_context="recompute")  # five calls under recompute
    assert 4.0 < out.stats["result"]["mean_steps"] <= 5.0


def test_a_head_file_without_the_head_verifier_is_refused(tiny_pipe):
    with pytest.raises(OptionError) as e:
        tiny_pipe(PROMPT, num_blocks=1, early_exit="target", exit_head="head.safetensors")
    assert "exit_head" in str(e.value)


def test_cli_says_up_front_which_exit_flags_it_will_not_read(tmp_path, capsys):
    from sdvg import cli

    assert cli.main(["generate", "--prompt", PROMPT, "--num-blocks", "1", "--mode", "target", "--exit-eps", "0.1",
                     "--exit-map", str(tmp_path / "m.png"), "--quiet", "--out", str(tmp_path / "v.mp4")]) == 0
    err = capsys.readouterr().err
    note = next(line for line in err.splitlines() if line.startswith("note:"))  # the unread flags and the fix
    assert "--exit-eps" in note and "--exit-map" in note and "--early-exit" in note
    assert not (tmp_path / "m.png").exists()
