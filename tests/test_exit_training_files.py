"""Exit-head training files are validated before use (docs/invariants.md, "Bad input"): a resumable training
checkpoint (finite tensors, step, losses, metadata keys, JSON, widths), the recorded hidden states, and an exit
head's metadata bounded before allocation; a non-finite or worse head never replaces the last good one. No model
is loaded."""
import json
import time

import pytest
import torch


def _checkpoint(tmp_path):
    from sdvg.evaluation import exit_calibration as ec

    config = ec.TrainConfig(steps=4, batch_size=2, checkpoint_every=2)
    state = ec.new_state(8, config)
    state.step, state.losses = 2, [0.5, 0.4]
    for p in state.head.parameters():  # Adam state as after two steps
        state.optimizer.state[p] = {"step": torch.tensor(2.0), "exp_avg": torch.zeros_like(p),
                                    "exp_avg_sq": torch.ones_like(p)}
    path = tmp_path / "checkpoint.safetensors"
    ec.save_checkpoint(path, state, config)
    return ec, config, path


def _rewrite(path, tensors=None, **meta):
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        old_meta, old = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
    old.update(tensors or {})
    old_meta.update(meta)
    save_file(old, str(path), metadata=old_meta)


def test_a_valid_checkpoint_resumes(tmp_path):
    ec, config, path = _checkpoint(tmp_path)
    state, _ = ec.load_checkpoint(path, config, dim=8)
    assert state.step == 2 and state.losses == [0.5, 0.4]


@pytest.mark.parametrize("damage,match", [
    ("nan", "NaN or inf"), ("negative_step", "step '-5'"), ("step_past", "past --steps"),
    ("losses", "finite numbers"), ("unknown_key", "unknown"), ("bad_json", "not valid JSON"),
    ("dim", "head width 1000000"), ("truncated", "not a readable safetensors"), ("foreign", "not a readable"),
    ("adam_step", "whole number of steps")])
def test_a_damaged_checkpoint_is_refused_before_use(tmp_path, damage, match):
    ec, config, path = _checkpoint(tmp_path)
    if damage == "nan":
        t = torch.zeros(8)
        t[3] = float("nan")
        _rewrite(path, {"head.norm.weight": t})
    elif damage == "negative_step":
        _rewrite(path, step="-5", losses="[]")
    elif damage == "step_past":
        _rewrite(path, step="9", losses=json.dumps([0.1] * 9))
    elif damage == "losses":
        _rewrite(path, losses="[0.5, NaN]")
    elif damage == "unknown_key":
        _rewrite(path, surprise="1")
    elif damage == "bad_json":
        _rewrite(path, config="{")
    elif damage == "dim":
        _rewrite(path, head_config=json.dumps({"dim": 1000000}))  # refused before allocating a 1e6-wide head
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:200])
    elif damage == "foreign":
        path.write_bytes(b"\x00" * 64)
    elif damage == "adam_step":
        _rewrite(path, {"adam.0.step": torch.tensor(-3.0)})
    with pytest.raises(ValueError, match=match):
        ec.load_checkpoint(path, config, dim=8)


def test_a_non_finite_or_worse_head_never_replaces_the_last_good_one(tmp_path):
    from sdvg.models.exit_head import ExitHead, ExitHeadConfig

    path = tmp_path / "head.safetensors"
    good = ExitHead(ExitHeadConfig(8))
    extra = {"generator": {"role": "target"}, "training_prompts": 1, "training_seeds": [0], "eps": 0.05}
    assert good.save(path, extra={**extra, "final_loss": 0.1})
    before = path.read_bytes()
    bad = ExitHead(ExitHeadConfig(8))
    with torch.no_grad():
        bad.out.weight.fill_(float("nan"))
    with pytest.raises(ValueError, match="NaN or inf"):
        bad.save(path, extra={**extra, "final_loss": 0.05})
    with pytest.warns(RuntimeWarning, match="lower loss"):
        assert not ExitHead(ExitHeadConfig(8)).save(path, extra={**extra, "final_loss": 0.2})
    assert path.read_bytes() == before
    assert ExitHead(ExitHeadConfig(8)).save(path, extra={**extra, "final_loss": 0.01})  # better: replaced


def test_damaged_records_are_refused(tmp_path):
    from sdvg.evaluation import exit_calibration as ec

    n, grid = 3, (1, 2, 2)
    rec = ec.Records(torch.zeros(n, 4), torch.zeros(n, 4), torch.tensor([0, 1, 2]), torch.zeros(n, dtype=torch.long),
                     torch.zeros(n, dtype=torch.long), grid, 4, torch.zeros(n, 4, 8))
    path = tmp_path / "records.safetensors"
    ec.save_records(path, rec, {"prompts": ["a"]})
    got, meta = ec.load_records(path)
    assert len(got) == n and meta == {"prompts": ["a"]}
    _rewrite(path, {"steps": torch.tensor([0, 1, 7])})
    with pytest.raises(ValueError, match="num_steps"):
        ec.load_records(path)
    ec.save_records(path, rec, {})
    _rewrite(path, grid="[1, 2, 3]")
    with pytest.raises(ValueError, match="hidden has shape"):
        ec.load_records(path)


def test_exit_head_metadata_is_bounded_before_allocation(tmp_path):
    from safetensors.torch import save_file

    from sdvg.models.exit_head import ExitHead, HEAD_FORMAT

    path = tmp_path / "h.safetensors"
    for config, match in (({"dim": 8, "channels": [10_000_000, 48], "pool": 2}, "channels 10000000"),
                          ({"dim": 8, "channels": [1e7, 48], "pool": 2}, "channels 10000000.0"),
                          ({"dim": 10**6, "channels": [96, 48], "pool": 2}, "dim 1000000")):
        save_file({"x": torch.zeros(1)}, str(path), metadata={"format": HEAD_FORMAT, "version": "1",
                                                              "config": json.dumps(config)})
        t0 = time.monotonic()
        with pytest.raises(ValueError, match=match):
            ExitHead.load(path)
        assert time.monotonic() - t0 < 5
