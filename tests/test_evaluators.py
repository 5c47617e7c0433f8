"""Evaluators: the named-metric interface, the --evaluator spec and its errors before any model loads,
per-metric retention in sweeps, reports and calibration, and the optional evaluators (drift with pyiqa's
MUSIQ, vbench in its own interpreter, VisionReward through transformers). Tests that need an optional
package skip without it; its missing-package error is tested by simulating the failed import."""
import csv
import json
import math
import statistics
import subprocess
import sys
import textwrap

import pytest
import torch

from sdvg import cli
from sdvg.evaluation import evaluators, external
from sdvg.evaluation.evaluators import (CallableEvaluator, Evaluator, EvaluatorSet, EvaluatorUnavailable, MetricSpec,
                                       as_evaluator, check_evaluator, load_evaluator, parse_spec)
from sdvg.evaluation.report import csv_text, markdown, write_reports
from sdvg.evaluation.sweep import (calibrate_retention, metric_specs, pareto, read_records, retention, run_sweep,
                                   summarise)
from sdvg.options import GenerationOptions
from test_sweep import _FakePipe, _no_model, _prompts, _sweep


def _frames(n, h=16, w=16, seed=0):
    return torch.randint(0, 256, (n, h, w, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


class _Two(Evaluator):
    """Two metrics of opposite directions; the values depend on the run (its mean pixel) so target and
    SDVG differ."""

    name = "two"
    metrics = (MetricSpec("sharp", positive=True), MetricSpec("wobble", higher_is_better=False))

    def __init__(self, values):
        self.values, self.calls = values, []

    def __call__(self, prompt, frames, fps=16, video_path=None):
        self.calls.append((prompt, tuple(frames.shape), fps, video_path))
        return dict(self.values(len(self.calls)))


# ---------------------------------------------------------------------------- the spec
def test_spec_parsing_and_unknown_names():
    assert parse_spec("imagereward") == [("imagereward", None)]
    assert parse_spec("imagereward, drift,vbench:subject_consistency+dynamic_degree,python:m.x:f") == [
        ("imagereward", None), ("drift", None), ("vbench", "subject_consistency+dynamic_degree"), ("python", "m.x:f")]
    for bad, msg in (("clip", "unknown evaluator 'clip'"), ("imagereward,,drift", "comma list"), ("", "comma list"),
                     ("drift:x", "takes no argument"), ("vbench:", "empty argument"), ("python:mod", "python:<module>"),
                     ("drift,drift", "appear twice")):
        with pytest.raises(ValueError, match=msg):
            parse_spec(bad)
    with pytest.raises(ValueError) as e:
        check_evaluator("vbench:color")
    assert "color" in str(e.value)
    with pytest.raises(ValueError) as e:
        check_evaluator("python:no_such_module:f")
    assert "no_such_module" in str(e.value)
    with pytest.raises(ValueError, match="not a callable"):
        check_evaluator("python:math:pi")


def test_python_callables_become_metrics(tmp_path, monkeypatch):
    mod = tmp_path / "my_metrics.py"
    mod.write_text(textwrap.dedent("""
        def clipscore(prompt, frames):
            return 0.25
        clipscore.positive = True

        def several(prompt, frames):
            return {"a": 1.0, "b": -2.0}
        several.higher_is_better = False
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    ev = load_evaluator("python:my_metrics:clipscore", pipe=None)
    assert isinstance(ev, CallableEvaluator) and ev.metrics == (MetricSpec("clipscore", True, True),)
    assert ev("p", _frames(2)) == {"clipscore": 0.25}
    both = load_evaluator("python:my_metrics:clipscore,python:my_metrics:several", pipe=None)
    assert isinstance(both, EvaluatorSet)
    values = both("p", _frames(2))
    assert values == {"clipscore": 0.25, "a": 1.0, "b": -2.0}
    assert both.specs_for(values)["b"] == MetricSpec("b", positive=False, higher_is_better=False)
    # a plain lambda keeps working (the sweep's old interface): one metric named "quality"
    plain = as_evaluator(lambda p, f: -1.0)
    assert plain("p", _frames(1)) == {"quality": -1.0} and not plain.metrics[0].positive


def test_imagereward_is_the_pipelines_scorer(tiny_pipe):
    ev = load_evaluator("imagereward", tiny_pipe)
    frames = _frames(20, 64, 64)
    out = ev("a cat", frames)
    assert list(out) == ["imagereward"] and ev.metrics[0] == MetricSpec("imagereward", False, True)
    idx = torch.linspace(0, 19, 16).round().long()
    assert out["imagereward"] == pytest.approx(float(tiny_pipe.components.scorer.score("a cat", frames[idx]).mean()))


# ---------------------------------------------------------------------------- records, reports, calibration
def test_sweep_records_every_metric_and_reports_each_retention(tmp_path):
    pipe = _FakePipe(walls=lambda o: {"target": 4.0, "draft": 1.0}.get(o.mode, 2.0))
    last = lambda: [c for c in pipe.calls if c[0] != "encode"][-1]  # noqa: E731
    ev = _Two(lambda n: {"sharp": 2.0 if last()[0] == "target" else 1.5,
                         "wobble": 0.1 if last()[0] == "target" else 0.3})
    recs = run_sweep(pipe, ["p0", "p1"], [-1.0], tmp_path, ev, GenerationOptions(), warmup=False,
                     evaluator_name="two", fps=8.0)
    assert ev.calls[0][2] == 8.0 and ev.calls[0][3] is None  # fps passed; no video file asked for
    r = recs[0]
    assert r["quality"] == 2.0 and r["quality_metric"] == "sharp" and r["quality_positive"] is True
    assert r["metrics"] == {"sharp": 2.0, "wobble": 0.1}
    assert r["metric_specs"]["wobble"] == {"positive": False, "higher_is_better": False}
    s = summarise(read_records(tmp_path))
    assert s["quality_metric"] == "sharp" and s["retention_kind"] == "ratio"
    row = s["taus"][0]
    assert row["retention"] == pytest.approx(0.75)  # 1.5 / 2.0, a positive metric
    assert row["metrics"]["wobble"]["retention"] == pytest.approx(-0.2)  # q_target - q: lower is better
    assert s["metrics"]["wobble"]["retention_formula"] == "q_target - q"
    md = markdown(s)
    assert "## Metrics" in md and "wobble ↓" in md and "retention (q_target − q)" in md and "-0.2000" in md
    rows = list(csv.DictReader(csv_text(s).splitlines()))
    assert float(rows[-1]["metric.wobble"]) == pytest.approx(0.3)
    assert float(rows[-1]["retention.wobble"]) == pytest.approx(-0.2)
    paths = write_reports(s, tmp_path)
    rep = json.loads(paths["report.json"].read_text())
    assert rep["quality_metric"] == "sharp" and rep["metrics"]["sharp"]["retention_kind"] == "ratio"


def test_retention_and_calibration_for_a_lower_is_better_quality():
    """Drift as the first metric: retention q_target - q, so a quality drop D lets drift rise by D."""
    def rec(tau, drift, wall):
        return {"prompt_index": 0, "tau": tau, "quality": drift, "wall_s": wall, "acceptance_rate": None,
                "quality_metric": "drift", "quality_positive": False, "quality_higher_is_better": False,
                "metrics": {"drift": drift}, "metric_specs": {"drift": {"positive": False, "higher_is_better": False}}}

    s = summarise([rec("target", 1.0, 4.0), rec(-2.0, 1.5, 1.0), rec(-1.0, 1.1, 2.0)])
    assert s["retention_formula"] == "q_target - q" and s["quality_higher_is_better"] is False
    assert [r["retention"] for r in s["taus"]] == pytest.approx([-0.5, -0.1])
    assert calibrate_retention(s, quality_drop=0.2)["tau"] == -1.0
    assert calibrate_retention(s, quality_drop=0.6)["tau"] == -2.0
    assert retention(2.0, 1.0, positive=True, higher_is_better=False) == 0.5
    assert retention(1.0, 0.0, positive=True) != retention(1.0, 0.0, positive=True)  # NaN, not a crash
    rows = [{"speedup": 1.0, "quality": 1.0}, {"speedup": 2.0, "quality": 1.5}, {"speedup": 1.5, "quality": 2.0}]
    assert [r["speedup"] for r in pareto(rows, higher_is_better=False)] == [1.0, 2.0]
    assert "lower is better" in markdown(s)


def test_metric_direction_must_agree():
    a = {"prompt_index": 0, "tau": "target", "quality": 1.0, "metrics": {"m": 1.0},
         "metric_specs": {"m": {"positive": True, "higher_is_better": True}}}
    b = {**a, "metric_specs": {"m": {"positive": False, "higher_is_better": False}}}
    with pytest.raises(ValueError, match="higher-is-better in some records"):
        metric_specs([a, b])
    assert metric_specs([a, {**b, "metric_specs": {"m": {"positive": False, "higher_is_better": True}}}])["m"][
        "positive"] is False  # positive only when every record declares it


def test_non_finite_metric_is_refused(tmp_path):
    with pytest.raises(ValueError, match="non-finite"):
        run_sweep(_FakePipe(walls=[1.0] * 9), ["p"], [-1.0], tmp_path, lambda p, f: math.nan, GenerationOptions(),
                  warmup=False)


def test_video_reading_evaluator_gets_the_sweeps_mp4(tmp_path):
    from sdvg.io.video_writer import read_mp4_frames

    class Reads(Evaluator):
        name = "reads"
        metrics = (MetricSpec("frames_read", positive=True),)
        needs_video_file = True

        def __call__(self, prompt, frames, fps=16, video_path=None):
            return {"frames_read": float(len(read_mp4_frames(video_path)))}

    recs = run_sweep(_FakePipe(walls=[1.0] * 9), ["p"], [-0.5], tmp_path, Reads(), GenerationOptions(), warmup=False)
    assert [r["video"] for r in recs] == ["videos/p00000_target.mp4", "videos/p00000_draft.mp4",
                                          "videos/p00000_tau-0.5.mp4"]
    assert all(r["metrics"]["frames_read"] == 21.0 for r in recs)


def test_cli_refuses_bad_evaluators_before_any_model_or_folder(tmp_path, monkeypatch, capsys):
    _no_model(monkeypatch)
    pf = _prompts(tmp_path)
    monkeypatch.setitem(sys.modules, "pyiqa", None)  # pyiqa not installed
    for spec, msg in (("clip", "unknown evaluator 'clip'"), ("imagereward,drift", "pyiqa does not import"),
                      ("vbench:color", "unknown color")):
        out = tmp_path / spec.replace(",", "_").replace(":", "_")
        assert cli.main(_sweep(pf, out, "--evaluator", spec)) == 2
        err = capsys.readouterr().err
        assert msg in err and not out.exists(), err
    assert cli.main(["calibrate", "--preset", "tiny", "--prompts-file", str(pf), "--quality-drop", "0.1",
                     "--out", str(tmp_path / "cal"), "--evaluator", "drift", "--quiet"]) == 2
    assert "pyiqa does not import" in capsys.readouterr().err


# ---------------------------------------------------------------------------- drift
def _index_scorer(frames):
    """Each frame's score is its first pixel's red value (frames built so that equals its index)."""
    return frames[:, 0, 0, 0].float().tolist()


def _indexed_frames(n):
    f = torch.zeros(n, 4, 4, 3, dtype=torch.uint8)
    f[:, 0, 0, 0] = torch.arange(n, dtype=torch.uint8)
    return f


def test_drift_segments_and_aggregation():
    assert external.drift_segments(81, 16) == [(0, 32), (32, 64)]  # the 17-frame tail is left out
    assert external.drift_segments(96, 16) == [(0, 32), (32, 64), (64, 96)]
    assert external.drift_segments(21, 16) == [(0, 21)]
    assert external.drift_segments(50, 24) == [(0, 48)]
    ev = external.DriftEvaluator(_index_scorer)
    # segment means 15.5 and 47.5: population std 16
    assert ev("p", _indexed_frames(81), fps=16) == {"drift": pytest.approx(16.0)}
    assert external.DriftEvaluator(_index_scorer, frame_stride=2)("p", _indexed_frames(81), fps=16)["drift"] == \
        pytest.approx(16.0)  # means of the even frames: 15 and 47
    three = ev("p", _indexed_frames(96), fps=16)["drift"]
    assert three == pytest.approx(statistics.pstdev([15.5, 47.5, 79.5]))
    with pytest.warns(UserWarning, match="fewer than two"):
        assert ev("p", _indexed_frames(21), fps=16) == {"drift": 0.0}
    assert ev.metrics == (MetricSpec("drift", positive=False, higher_is_better=False),)


def test_drift_missing_package_and_weights_in_one_message(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyiqa", None)
    monkeypatch.setenv(external.MUSIQ_ENV, str(tmp_path / "nope.pth"))
    with pytest.raises(EvaluatorUnavailable) as exc:
        check_evaluator("drift")
    msg = str(exc.value)
    assert msg.startswith("evaluator 'drift' cannot run") and "pyiqa does not import" in msg
    assert "requirements-eval.txt" in msg and "nope.pth" in msg and external.MUSIQ_URL in msg


@pytest.mark.slow
def test_drift_with_pyiqas_musiq_on_random_weights(tmp_path, monkeypatch):
    """pyiqa's real MUSIQ (create_metric("musiq"), KonIQ architecture) built without its download, its
    random weights saved and loaded back through SDVG_MUSIQ_WEIGHTS, as `--evaluator drift` loads them."""
    pyiqa = pytest.importorskip("pyiqa", reason="pyiqa is optional (requirements-eval.txt)")
    metric = pyiqa.create_metric("musiq", device="cpu", pretrained=False)
    weights = tmp_path / "musiq.pth"
    torch.save({k: v.half() for k, v in metric.net.state_dict().items()}, weights)
    monkeypatch.setenv(external.MUSIQ_ENV, str(weights))
    ev = load_evaluator("drift", pipe=None)
    assert isinstance(ev, external.DriftEvaluator)
    frames = _frames(6, 32, 40)
    got = ev("p", frames, fps=1.0)["drift"]  # 2-frame segments: three of them
    ref = pyiqa.create_metric("musiq", device="cpu", pretrained_model_path=str(weights))
    with torch.no_grad():
        s = ref(frames.permute(0, 3, 1, 2).float() / 255).reshape(-1).tolist()
    assert got == pytest.approx(statistics.pstdev([statistics.fmean(s[k:k + 2]) for k in (0, 2, 4)]), rel=1e-5)
    assert got > 0 and len(set(s)) > 1


# ---------------------------------------------------------------------------- vbench
def _vbench_runs() -> bool:
    r = subprocess.run([external.vbench_python(), "-c", "import vbench, vbench.temporal_flickering"],
                       capture_output=True)
    return r.returncode == 0


def test_vbench_dimensions_and_job():
    assert external.vbench_dimensions(None) == external.DEFAULT_VBENCH_DIMENSIONS
    assert external.vbench_dimensions("dynamic_degree+imaging_quality") == ("dynamic_degree", "imaging_quality")
    for bad in ("scene", "dynamic_degree+dynamic_degree"):
        with pytest.raises(ValueError) as e:
            external.vbench_dimensions(bad)
        assert bad.split('+')[0] in str(e.value)
    ev = external.VBenchEvaluator(("dynamic_degree", "imaging_quality"), device="cpu")
    assert ev.needs_video_file and [m.name for m in ev.metrics] == ["vbench.dynamic_degree", "vbench.imaging_quality"]
    assert [m.positive for m in ev.metrics] == [False, True]  # dynamic_degree is 0 or 1: a difference


def test_vbench_job_is_vbenchs_custom_input(tmp_path):
    job = external.vbench_job(tmp_path / "videos" / "p00003_tau-1.mp4", "a dog", ("subject_consistency",), "cuda:0",
                              tmp_path / "videos" / "vbench")
    assert job == {"video": str(tmp_path / "videos" / "p00003_tau-1.mp4"), "prompt": "a dog",
                   "dimensions": ["subject_consistency"], "device": "cuda:0",
                   "output": str(tmp_path / "videos" / "vbench"), "name": "p00003_tau-1",
                   "result": str(tmp_path / "videos" / "vbench" / "p00003_tau-1_scores.json")}


def test_vbench_missing_package_and_weights(tmp_path, monkeypatch):
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "vbench.py").write_text("raise ImportError(\"No module named 'decord'\")\n")
    monkeypatch.setenv("PYTHONPATH", str(shim))  # the vbench interpreter finds a broken vbench
    monkeypatch.setenv(external.VBENCH_PYTHON_ENV, sys.executable)
    monkeypatch.setenv("VBENCH_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(EvaluatorUnavailable) as exc:
        check_evaluator("vbench:dynamic_degree+temporal_flickering")
    msg = str(exc.value)
    assert "No module named 'decord'" in msg and "requirements-vbench.txt" in msg and "SDVG_VBENCH_PYTHON" in msg
    assert str(tmp_path / "cache" / "raft_model" / "models" / "raft-things.pth") in msg
    monkeypatch.setenv(external.VBENCH_PYTHON_ENV, str(tmp_path / "no-python"))
    with pytest.raises(EvaluatorUnavailable, match="does not run"):
        check_evaluator("vbench:temporal_flickering")


@pytest.mark.slow
@pytest.mark.skipif(not _vbench_runs(), reason="the vbench package is optional (requirements-vbench.txt, "
                                               "SDVG_VBENCH_PYTHON)")
def test_vbench_runs_a_dimension_without_weights(tmp_path, monkeypatch):
    """The real VBench (custom_input) on sweep-written MP4s: temporal_flickering needs no weights."""
    from sdvg.io.video_writer import read_mp4_frames

    monkeypatch.setenv("VBENCH_CACHE_DIR", str(tmp_path / "cache"))
    ev = load_evaluator("vbench:temporal_flickering", pipe=None)
    pipe = _FakePipe(walls=[1.0] * 9)
    noisy = _frames(21, 32, 32, seed=3)
    pipe_generate = pipe.generate

    def generate(prompt, opts):  # a static video for target-only, noise for the others
        out = pipe_generate(prompt, opts)
        out.frames = torch.full_like(noisy, 100) if opts.mode == "target" else noisy
        return out

    pipe.generate = generate
    recs = run_sweep(pipe, ["a cat"], [-1.0], tmp_path, ev, GenerationOptions(), warmup=False, draft=False)
    target, sdvg = recs
    assert target["metrics"] == {"vbench.temporal_flickering": 1.0}  # no change between frames
    info = json.loads((tmp_path / "videos" / "vbench" / "p00000_tau-1_full_info.json").read_text())
    assert info == [{"prompt_en": "a cat", "dimension": ["temporal_flickering"],
                     "video_list": [str(tmp_path / "videos" / "p00000_tau-1.mp4")]}]
    f = read_mp4_frames(tmp_path / sdvg["video"]).astype("float32")  # VBench: 1 - mean |frame change| / 255
    want = 1 - statistics.fmean(float(abs(f[k + 1] - f[k]).mean()) for k in range(len(f) - 1)) / 255
    assert sdvg["metrics"]["vbench.temporal_flickering"] == pytest.approx(want, abs=2e-3)


# ---------------------------------------------------------------------------- VisionReward
def _visionreward_folder(tmp_path, questions=("Is it a [[prompt]]?", "Is it sharp?", "Is it [[prompt]] moving?"),
                         weights=(0.5, 0.25, 1.0), files=True):
    folder = tmp_path / "VisionReward-Video"
    folder.mkdir()
    (folder / external.VISIONREWARD_QUESTIONS).write_text("\n".join(questions) + "\n")
    (folder / external.VISIONREWARD_WEIGHTS).write_text(json.dumps(list(weights)))
    if files:
        (folder / "config.json").write_text("{}")
        (folder / "model-00001-of-00001.safetensors").write_bytes(b"")
    return folder


def test_visionreward_folder_checks(tmp_path, monkeypatch):
    monkeypatch.delenv(external.VISIONREWARD_ENV, raising=False)
    with pytest.raises(EvaluatorUnavailable, match="THUDM/VisionReward-Video"):
        check_evaluator("visionreward")
    with pytest.raises(EvaluatorUnavailable) as e:
        check_evaluator(f"visionreward:{tmp_path / 'absent'}")
    assert all(s in str(e.value) for s in (str(tmp_path / 'absent'), "not a folder")), e.value
    bare = _visionreward_folder(tmp_path, files=False)
    with pytest.raises(EvaluatorUnavailable) as e:
        check_evaluator(f"visionreward:{bare}")
    assert all(s in str(e.value) for s in ("config.json", "*.safetensors")), e.value
    (bare / "config.json").write_text("{}")
    (bare / "model.safetensors").write_bytes(b"")
    monkeypatch.setenv(external.VISIONREWARD_ENV, str(bare))
    assert check_evaluator("visionreward") == [("visionreward", None)]
    (bare / external.VISIONREWARD_WEIGHTS).write_text("[1.0]")
    with pytest.raises(EvaluatorUnavailable) as e:
        check_evaluator("visionreward")
    assert all(s in str(e.value) for s in ("3 questions", "1 weights")), e.value


def test_visionreward_load_failure_names_transformers(tmp_path):
    """transformers' real Auto classes on a folder that is not a model: one clear error."""
    import transformers

    folder = _visionreward_folder(tmp_path)
    with pytest.raises(EvaluatorUnavailable) as e:
        external.load_visionreward_model(folder, "cpu")
    assert f"transformers {transformers.__version__}" in str(e.value)


def test_visionreward_frame_choice_follows_the_reference():
    assert external.chat_frame_indices(81, 16) == [0, 16, 32, 48, 64, 80]
    assert external.chat_frame_indices(21, 16) == [0, 16]
    assert external.chat_frame_indices(3, 16) == [0]
    assert external.chat_frame_indices(40 * 16, 16) == [16 * s for s in range(24)]  # at most 24


def _tiny_visionreward(tmp_path):
    """A stand-in with VisionReward's call surface (build_conversation_input_ids, forward -> logits),
    saved and loaded through transformers' Auto classes: it answers "yes" exactly when the question
    holds the word "cat" and the video's mean pixel is above 100. CogVLM2-Video itself needs its
    remote code and 24 GB of weights from the hub."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import (AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel,
                              PreTrainedTokenizerFast)
    from transformers.modeling_outputs import CausalLMOutput

    words = ["<unk>", "yes", "no", "cat", "dog", "is", "it", "a", "sharp", "moving", "?"]
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")

    class Cfg(PretrainedConfig):
        model_type = "sdvg-test-visionreward"

    class Model(PreTrainedModel):
        config_class = Cfg

        def __init__(self, config):
            super().__init__(config)
            self.scale = torch.nn.Parameter(torch.ones(1))
            self.seen = []
            self.post_init()

        def build_conversation_input_ids(self, tokenizer, query, images, history, template_version):
            assert template_version == "chat" and history == []
            ids = torch.tensor(tokenizer(query.lower())["input_ids"])
            return {"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "attention_mask": torch.ones_like(ids),
                    "images": [images[0]]}

        def forward(self, input_ids, token_type_ids, attention_mask, images):
            video = images[0][0]
            self.seen.append(tuple(video.shape))
            yes = bool((input_ids == 3).any()) and float(video.float().mean()) > 100
            logits = torch.zeros(1, input_ids.shape[1], len(words))
            logits[0, -1, 1 if yes else 2] = self.scale * 5
            return CausalLMOutput(logits=logits)

    AutoConfig.register(Cfg.model_type, Cfg, exist_ok=True)
    AutoModelForCausalLM.register(Cfg, Model, exist_ok=True)
    folder = _visionreward_folder(tmp_path, files=False)
    Model(Cfg()).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_visionreward_scores_the_checklist(tmp_path, monkeypatch):
    folder = _tiny_visionreward(tmp_path)
    monkeypatch.setenv(external.VISIONREWARD_ENV, str(folder))
    ev = load_evaluator("visionreward", pipe=None)  # check, then transformers' Auto classes on the folder
    assert isinstance(ev, external.VisionRewardEvaluator) and ev.metrics[0].name == "visionreward"
    bright = torch.full((81, 8, 8, 3), 200, dtype=torch.uint8)
    # "cat" is in questions 1 and 3 (the prompt filled in): +0.5, -0.25, +1.0 over three questions
    assert ev("cat", bright, fps=16) == {"visionreward": pytest.approx((0.5 - 0.25 + 1.0) / 3)}
    assert ev.model.seen[-1] == (3, 6, 8, 8)  # [C, T, H, W]: one frame per second, 0..5 s
    assert ev("dog", bright, fps=16) == {"visionreward": pytest.approx(-(0.5 + 0.25 + 1.0) / 3)}
    assert ev("cat", torch.zeros_like(bright), fps=16)["visionreward"] == pytest.approx(-(0.5 + 0.25 + 1.0) / 3)
