"""Optional evaluators backed by other libraries: `drift` (pyiqa's MUSIQ), `vbench` (the vbench package, in its own interpreter) and `visionreward` (VisionReward-Video through transformers).

None of these packages is part of sdvg's runtime stack (requirements.txt). Each evaluator has a
`check_*` that runs before any model loads and raises one `EvaluatorUnavailable` naming everything
missing (package, weights, folder) and how to get it. docs/evaluation.md has the set-up of each."""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

from sdvg.evaluation.evaluator_base import Evaluator, EvaluatorUnavailable, MetricSpec
from sdvg.io import DEFAULT_FPS

# ---------------------------------------------------------------------------- drift (MUSIQ)
MUSIQ_FILE = "musiq_koniq_ckpt-e95806b9.pth"  # pyiqa's `musiq` metric: MUSIQ trained on KonIQ-10k
MUSIQ_URL = f"https://huggingface.co/chaofengc/IQA-PyTorch-Weights/resolve/main/{MUSIQ_FILE}"
MUSIQ_ENV = "SDVG_MUSIQ_WEIGHTS"
EVAL_INSTALL = "pip install --no-deps -r requirements-eval.txt (or pip install -c requirements-lock.txt '.[eval]')"


def musiq_weights_candidates(path: str | os.PathLike | None = None) -> list[Path]:
    """Where the MUSIQ weights are looked for: `path`, else $SDVG_MUSIQ_WEIGHTS, else pyiqa's own
    download cache (<torch hub dir>/pyiqa/musiq_koniq_ckpt-e95806b9.pth)."""
    if path is not None:
        return [Path(path)]
    if os.environ.get(MUSIQ_ENV):
        return [Path(os.environ[MUSIQ_ENV])]
    import torch

    return [Path(torch.hub.get_dir()) / "pyiqa" / MUSIQ_FILE]


def check_drift(weights: str | os.PathLike | None = None) -> Path:
    """The MUSIQ weights file, once pyiqa imports and the file exists (nothing is downloaded)."""
    problems = []
    try:
        import pyiqa  # noqa: F401
    except ImportError as exc:
        problems.append(f"the package pyiqa does not import ({exc}); install it with {EVAL_INSTALL}")
    candidates = musiq_weights_candidates(weights)
    found = next((p for p in candidates if p.is_file()), None)
    if found is None:
        problems.append(f"MUSIQ's KonIQ-10k weights ({MUSIQ_FILE}) are not at {', '.join(map(str, candidates))}; "
                        f"download them from {MUSIQ_URL} and set {MUSIQ_ENV}=<the file>")
    if problems:
        raise EvaluatorUnavailable("evaluator 'drift' cannot run: " + "; ".join(problems))
    return found


def drift_segments(num_frames: int, fps: float, seconds: float = 2.0) -> list[tuple[int, int]]:
    """Non-overlapping segments of `seconds` (round(seconds * fps) frames; 32 at 16 fps) from the first
    frame; a trailing part shorter than a segment is left out. A video shorter than one segment is one
    segment of all its frames."""
    if num_frames < 1:
        raise ValueError("drift of a video without frames")
    if not fps > 0 or not seconds > 0:
        raise ValueError(f"fps {fps} and segment length {seconds} s must be > 0")
    length = max(1, round(seconds * fps))
    n = num_frames // length
    if n == 0:
        return [(0, num_frames)]
    return [(k * length, (k + 1) * length) for k in range(n)]


def drift_from_scores(segment_scores: list[list[float]]) -> float:
    """The population standard deviation of the segments' mean scores (0.0 for a single segment)."""
    means = [statistics.fmean(s) for s in segment_scores]
    return statistics.pstdev(means) if len(means) > 1 else 0.0


class DriftEvaluator(Evaluator):
    """Speculative Forcing's drift: the standard deviation, over a video's non-overlapping 2-second
    segments, of the segment's mean per-frame MUSIQ score (every `frame_stride`-th frame is scored).
    Non-negative, lower is better; a video with fewer than two segments has drift 0.0 (with a warning).
    `scorer(frames uint8 [N, H, W, 3]) -> N scores`."""

    name = "drift"
    metrics = (MetricSpec("drift", positive=False, higher_is_better=False),)

    def __init__(self, scorer, segment_seconds: float = 2.0, frame_stride: int = 1):
        if frame_stride < 1:
            raise ValueError(f"frame_stride {frame_stride} must be >= 1")
        self.scorer, self.segment_seconds, self.frame_stride = scorer, segment_seconds, frame_stride

    @classmethod
    def from_pyiqa(cls, weights=None, device: str = "cpu", batch_size: int = 8, **kw) -> "DriftEvaluator":
        """With pyiqa's MUSIQ (`pyiqa.create_metric("musiq")`) on the weights `check_drift` finds."""
        path = check_drift(weights)
        import pyiqa

        metric = pyiqa.create_metric("musiq", device=device, pretrained_model_path=str(path))
        return cls(musiq_scorer(metric, batch_size), **kw)

    def segment_scores(self, frames, fps: float) -> list[list[float]]:
        segments = drift_segments(frames.shape[0], fps, self.segment_seconds)
        idx = [list(range(a, b, self.frame_stride)) for a, b in segments]
        flat = [i for seg in idx for i in seg]
        scores = [float(s) for s in self.scorer(frames[flat])]
        if len(scores) != len(flat):
            raise ValueError(f"the MUSIQ scorer returned {len(scores)} scores for {len(flat)} frames")
        out, k = [], 0
        for seg in idx:
            out.append(scores[k:k + len(seg)])
            k += len(seg)
        return out

    def __call__(self, prompt, frames, fps=DEFAULT_FPS, video_path=None):
        per_segment = self.segment_scores(frames, fps)
        if len(per_segment) < 2:
            warnings.warn(f"drift: a video of {frames.shape[0]} frames at {fps:g} fps has fewer than two "
                          f"{self.segment_seconds:g}-second segments; its drift is 0.0", stacklevel=2)
        return {"drift": drift_from_scores(per_segment)}


def musiq_scorer(metric, batch_size: int = 8):
    """frames uint8 [N, H, W, 3] -> N MUSIQ scores from a pyiqa metric (inputs RGB in [0, 1])."""
    import torch

    def score(frames):
        out = []
        with torch.no_grad():
            for k in range(0, frames.shape[0], batch_size):
                x = frames[k:k + batch_size].permute(0, 3, 1, 2).float().div(255.0)
                out += metric(x).reshape(-1).tolist()
        return out

    return score


# ---------------------------------------------------------------------------- VBench
VBENCH_PYTHON_ENV = "SDVG_VBENCH_PYTHON"
VBENCH_INSTALL = ("vbench 0.1.5 pins transformers 4.33.2 and numpy < 2, so it cannot share sdvg's environment: "
                  "build its own (python -m venv ~/.venvs/vbench && ~/.venvs/vbench/bin/pip install -r "
                  f"requirements-vbench.txt) and set {VBENCH_PYTHON_ENV}=~/.venvs/vbench/bin/python")
_CLIP_B = "clip_model/ViT-B-32.pt"
# per dimension: (higher-is-better metric, whether every score is > 0, the files VBench reads under
# $VBENCH_CACHE_DIR in local mode, as vbench 0.1.5's init_submodules names them)
VBENCH_DIMENSIONS: dict[str, tuple[bool, tuple[str, ...]]] = {
    "subject_consistency": (True, ("dino_model/facebookresearch_dino_main/hubconf.py",
                                   "dino_model/dino_vitbase16_pretrain.pth")),
    "background_consistency": (True, (_CLIP_B,)),
    "motion_smoothness": (True, ("amt_model/amt-s.pth",)),
    "dynamic_degree": (False, ("raft_model/models/raft-things.pth",)),  # 0 or 1 per video: a difference
    "aesthetic_quality": (True, ("clip_model/ViT-L-14.pt", "aesthetic_model/emb_reader/sa_0_4_vit_l_14_linear.pth")),
    "imaging_quality": (True, ("pyiqa_model/musiq_spaq_ckpt-358bb6af.pth",)),
    "temporal_flickering": (True, ()),
}
DEFAULT_VBENCH_DIMENSIONS = ("subject_consistency", "background_consistency", "motion_smoothness", "dynamic_degree",
                             "aesthetic_quality", "imaging_quality")
VBENCH_JOB = Path(__file__).with_name("vbench_job.py")


def vbench_cache_dir() -> Path:
    """VBench's weights folder: $VBENCH_CACHE_DIR, else ~/.cache/vbench (as vbench reads it)."""
    return Path(os.environ.get("VBENCH_CACHE_DIR") or Path.home() / ".cache" / "vbench")


def vbench_python() -> str:
    return os.environ.get(VBENCH_PYTHON_ENV) or sys.executable


def vbench_dimensions(arg: str | None) -> tuple[str, ...]:
    """`None` -> the default six; else "dim+dim..." checked against the supported dimensions."""
    if arg is None:
        return DEFAULT_VBENCH_DIMENSIONS
    dims = tuple(d.strip() for d in arg.split("+"))
    bad = [d for d in dims if d not in VBENCH_DIMENSIONS]
    if bad or len(set(dims)) != len(dims):
        raise ValueError(f"vbench dimensions {arg!r}: {'unknown ' + ', '.join(bad) if bad else 'repeated'}; "
                         f"choose from {', '.join(VBENCH_DIMENSIONS)} (joined by '+'); the others need "
                         "VBench's own prompt suite, not custom videos")
    return dims


def missing_vbench_weights(dims, cache: Path | None = None) -> list[Path]:
    cache = cache or vbench_cache_dir()
    return [cache / rel for d in dims for rel in VBENCH_DIMENSIONS[d][1] if not (cache / rel).is_file()]


def probe_vbench(python: str) -> str | None:
    """None when `python -c "import vbench"` works; else why not (the last line of its error)."""
    try:
        r = subprocess.run([python, "-c", "import vbench"], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{python} does not run ({exc})"
    if r.returncode == 0:
        return None
    lines = [x for x in r.stderr.strip().splitlines() if x.strip()]
    return lines[-1] if lines else f"exit status {r.returncode}"


def check_vbench(arg: str | None = None) -> tuple[str, ...]:
    """The dimensions, once vbench imports in its interpreter and their weights are in VBench's cache
    (checked here because vbench itself would try to download them)."""
    dims = vbench_dimensions(arg)
    problems = []
    python = vbench_python()
    why = probe_vbench(python)
    if why is not None:
        problems.append(f"vbench does not import in {python} ({why}); {VBENCH_INSTALL}")
    missing = missing_vbench_weights(dims)
    if missing:
        problems.append(f"VBench's weights for {', '.join(dims)} are missing: {', '.join(map(str, missing))}; fetch "
                        "them as vbench's init_submodules would (with network access, or copy a filled "
                        "~/.cache/vbench) and set VBENCH_CACHE_DIR to that folder")
    if problems:
        raise EvaluatorUnavailable("evaluator 'vbench' cannot run: " + "; ".join(problems))
    return dims


def vbench_job(video: Path, prompt: str, dims, device: str, output: Path) -> dict:
    """What `vbench_job.py` runs: VBench's custom_input mode on one video with its prompt."""
    video = Path(video).resolve()
    output = Path(output).resolve()
    return {"video": str(video), "prompt": prompt, "dimensions": list(dims), "device": device,
            "output": str(output), "name": video.stem, "result": str(output / f"{video.stem}_scores.json")}


def run_vbench(job: dict, python: str | None = None, timeout: float | None = None) -> dict[str, float]:
    """Run `job` in the vbench interpreter; {dimension: the video's score}."""
    out = Path(job["output"])
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{job['name']}_job.json"
    path.write_text(json.dumps(job, indent=2), encoding="utf-8")
    result = Path(job["result"])
    result.unlink(missing_ok=True)
    env = {**os.environ, "VBENCH_CACHE_DIR": str(vbench_cache_dir())}
    r = subprocess.run([python or vbench_python(), str(VBENCH_JOB), str(path)], capture_output=True, text=True,
                       timeout=timeout, env=env)
    if r.returncode != 0 or not result.is_file():
        tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"VBench failed on {job['video']} (exit status {r.returncode}):\n{tail}")
    return {k: float(v) for k, v in json.loads(result.read_text(encoding="utf-8")).items()}


class VBenchEvaluator(Evaluator):
    """Selected VBench dimensions of each video (metrics `vbench.<dimension>`, higher is better). VBench
    reads MP4s: the sweep writes each run's video into `<out>/videos/`, and VBench's files (its
    full_info and eval_results JSON per video) go to `videos/vbench/` beside it (or `output`). VBench
    runs in its own interpreter (`$SDVG_VBENCH_PYTHON`) and loads its models for every video."""

    name = "vbench"
    needs_video_file = True

    def __init__(self, dimensions=DEFAULT_VBENCH_DIMENSIONS, device: str = "cuda", python: str | None = None,
                 output: Path | None = None, timeout: float | None = None):
        self.dimensions = tuple(dimensions)
        self.device, self.python, self.output, self.timeout = device, python, output, timeout
        self.metrics = tuple(MetricSpec(f"vbench.{d}", positive=VBENCH_DIMENSIONS[d][0], higher_is_better=True)
                             for d in self.dimensions)

    def __call__(self, prompt, frames, fps=DEFAULT_FPS, video_path=None):
        with tempfile.TemporaryDirectory(prefix="sdvg-vbench-") as tmp:
            if video_path is None:  # called outside a sweep: write the frames out
                from sdvg.io.video_writer import IncrementalMP4Writer

                video_path = Path(tmp) / "video.mp4"
                with IncrementalMP4Writer(video_path, fps=fps) as w:
                    w.write(frames)
            output = self.output or Path(video_path).parent / "vbench"
            job = vbench_job(Path(video_path), prompt, self.dimensions, self.device, output)
            scores = run_vbench(job, self.python, self.timeout)
        missing = [d for d in self.dimensions if d not in scores]
        if missing:
            raise RuntimeError(f"VBench returned no score for {missing} of {video_path}")
        return {f"vbench.{d}": scores[d] for d in self.dimensions}


# ---------------------------------------------------------------------------- VisionReward
VISIONREWARD_ENV = "SDVG_VISIONREWARD_DIR"
VISIONREWARD_QUESTIONS = "VisionReward_video_qa_select.txt"
VISIONREWARD_WEIGHTS = "weight.json"
VISIONREWARD_HOW = ("a folder holding the Hugging Face snapshot of THUDM/VisionReward-Video (config.json, its "
                    "modeling code, tokenizer and weight files) plus VisionReward_Video/VisionReward_video_qa_select"
                    ".txt and VisionReward_Video/weight.json from github.com/THUDM/VisionReward copied into it; "
                    f"give it as --evaluator visionreward:<folder> or {VISIONREWARD_ENV}=<folder>")


def visionreward_checklist(folder: Path) -> tuple[list[str], list[float]]:
    """The checklist questions (with "[[prompt]]" to fill) and their weights."""
    questions = [q.rstrip("\n") for q in (folder / VISIONREWARD_QUESTIONS).read_text(encoding="utf-8").splitlines()]
    questions = [q for q in questions if q.strip()]
    weights = [float(w) for w in json.loads((folder / VISIONREWARD_WEIGHTS).read_text(encoding="utf-8"))]
    if len(questions) != len(weights):
        raise EvaluatorUnavailable(f"evaluator 'visionreward': {len(questions)} questions in {VISIONREWARD_QUESTIONS} "
                                   f"but {len(weights)} weights in {VISIONREWARD_WEIGHTS} ({folder})")
    return questions, weights


def check_visionreward(folder: str | os.PathLike | None = None) -> Path:
    """The VisionReward folder, once it holds the model, its code and the checklist (nothing is loaded)."""
    folder = folder or os.environ.get(VISIONREWARD_ENV)
    if not folder:
        raise EvaluatorUnavailable(f"evaluator 'visionreward' needs {VISIONREWARD_HOW}")
    folder = Path(folder)
    if not folder.is_dir():
        raise EvaluatorUnavailable(f"evaluator 'visionreward': {folder} is not a folder; it needs {VISIONREWARD_HOW}")
    missing = [n for n in ("config.json", VISIONREWARD_QUESTIONS, VISIONREWARD_WEIGHTS) if not (folder / n).is_file()]
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        missing.append("the weights (*.safetensors)")
    if missing:
        raise EvaluatorUnavailable(f"evaluator 'visionreward': {folder} lacks {', '.join(missing)}; it needs "
                                   f"{VISIONREWARD_HOW}")
    visionreward_checklist(folder)
    return folder


def chat_frame_indices(num_frames: int, fps: float, max_frames: int = 24) -> list[int]:
    """VisionReward's frame choice (the 'chat' strategy of its inference-video.py): for each whole
    second 0, 1, ... up to round(the last frame's time), the frame whose time is closest; at most 24."""
    times = [i / fps for i in range(num_frames)]
    out = []
    for second in range(round(times[-1]) + 1):
        out.append(min(range(num_frames), key=lambda i: abs(times[i] - second)))
        if len(out) >= max_frames:
            break
    return out


def load_visionreward_model(folder: Path, device: str, dtype=None):
    """VisionReward-Video's tokenizer and model from `folder` (its own code: trust_remote_code)."""
    import torch
    import transformers

    if dtype is None:
        dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=True, local_files_only=True)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, trust_remote_code=True,
                                                                  local_files_only=True)
    except Exception as exc:  # the remote code's failures are of any type
        raise EvaluatorUnavailable(
            f"evaluator 'visionreward': loading {folder} with transformers {transformers.__version__} failed "
            f"({type(exc).__name__}: {exc}). VisionReward-Video's code (CogVLM2-Video) was written for "
            "transformers 4.42 and needs its own packages (decord, pytorchvideo, xformers, einops, timm)") from exc
    return tokenizer, model.eval().to(device)


class VisionRewardEvaluator(Evaluator):
    """VisionReward-Video's score: for each checklist question (the prompt filled in), +1 when the model's
    next token after the question is "yes", else -1; the score is the mean of those answers times the
    question's weight (as `score` in its inference-video.py; the greedy first token is the argmax of one
    forward pass). Sign-indefinite, higher is better."""

    name = "visionreward"
    metrics = (MetricSpec("visionreward", positive=False, higher_is_better=True),)

    def __init__(self, folder, device: str = "cuda", dtype=None, model=None, tokenizer=None):
        self.folder = Path(folder)
        self.questions, self.weights = visionreward_checklist(self.folder)
        if model is None:
            tokenizer, model = load_visionreward_model(self.folder, device, dtype)
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.dtype = dtype or next(model.parameters()).dtype

    def video_tensor(self, frames, fps: float):
        """uint8 [C, T, H, W] of the chosen frames (what decord's torch bridge gives the reference)."""
        return frames[chat_frame_indices(frames.shape[0], fps)].permute(3, 0, 1, 2).contiguous()

    def answer_yes(self, video, query: str) -> bool:
        import torch

        inputs = self.model.build_conversation_input_ids(tokenizer=self.tokenizer, query=query, images=[video],
                                                         history=[], template_version="chat")
        feed = {"input_ids": inputs["input_ids"].unsqueeze(0).to(self.device),
                "token_type_ids": inputs["token_type_ids"].unsqueeze(0).to(self.device),
                "attention_mask": inputs["attention_mask"].unsqueeze(0).to(self.device),
                "images": [[inputs["images"][0].to(self.device).to(self.dtype)]]}
        with torch.no_grad():
            logits = self.model(**feed).logits[0, -1]
        return self.tokenizer.decode([int(logits.argmax())]) == "yes"

    def __call__(self, prompt, frames, fps=DEFAULT_FPS, video_path=None):
        video = self.video_tensor(frames, fps)
        answers = [1.0 if self.answer_yes(video, q.replace("[[prompt]]", prompt)) else -1.0 for q in self.questions]
        score = statistics.fmean(a * w for a, w in zip(answers, self.weights))
        if not math.isfinite(score):
            raise RuntimeError("VisionReward gave a non-finite score")
        return {"visionreward": score}
