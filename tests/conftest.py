import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none visible)")
    try:
        import tensorrt  # noqa: F401
        have_trt = True
    except Exception:
        have_trt = False
    no_trt = pytest.mark.skip(reason="needs TensorRT (`pip install .[tensorrt]`) and a GPU")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        if "tensorrt" in item.keywords and not (have_trt and torch.cuda.is_available()):
            item.add_marker(no_trt)


@pytest.fixture(scope="session")
def tiny_pipe():
    from sdvg import SpeculativeVideoPipeline

    return SpeculativeVideoPipeline.from_preset("tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_preset():
    from sdvg.config import get_preset

    return get_preset("tiny")


def randomize(module, std=0.2, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return module


def write_real_checkpoints(components, folder):
    """Every component of a pipeline written in its real on-disk format (Self-Forcing .pt drafter,
    Krea-style .safetensors target, diffusers VAE folder, ImageReward.pt, BERT tokenizer folder,
    diffusers Wan folder with text_encoder/ and tokenizer/); returns {role: path}."""
    from sdvg.models.checkpoints import save_dit
    from sdvg.models.reward import save_image_reward_weights
    from sdvg.models.tokenizers import tiny_bert_tokenizer

    c = components
    paths = dict(drafter=folder / "self_forcing.pt", target=folder / "krea.safetensors", vae=folder / "vae",
                 reward=folder / "ImageReward.pt", reward_tokenizer=folder / "bert", text_encoder=folder / "wan")
    save_dit(c.drafter, paths["drafter"], "self-forcing")
    save_dit(c.target, paths["target"], "krea")
    c.vae.vae.save_pretrained(paths["vae"])
    save_image_reward_weights(c.scorer.model, paths["reward"])  # the package's key names
    tiny_bert_tokenizer().save_pretrained(paths["reward_tokenizer"])
    c.text_encoder.model.save_pretrained(paths["text_encoder"] / "text_encoder")
    c.text_encoder.tokenizer.save_pretrained(paths["text_encoder"] / "tokenizer")
    return paths


@pytest.fixture(scope="module")
def dit():
    """A tiny target-sized causal Wan DiT with random weights (one per test module)."""
    from sdvg.config import get_preset
    from sdvg.models.dit import CausalWanDiT

    torch.manual_seed(0)
    return randomize(CausalWanDiT(get_preset("tiny").target).eval(), std=0.2)


@pytest.fixture(scope="module")
def text(dit):
    """Its cross-attention K/V of a fixed random 512-token text embedding."""
    return dit.encode_text(torch.randn(1, 512, 32, generator=torch.Generator().manual_seed(1)))


@pytest.fixture(scope="session")
def tiny_onnx_build(tmp_path_factory):
    """`python -m build_engines --preset tiny --format onnx --verify --out FOLDER` run once per session, as a
    real process: every tiny engine exported (export_onnx), checked against eager in onnxruntime (verify_onnx)
    and stored in the engine cache. `.out`: the folder; `.proc`: the finished process (its stdout has one
    verification line per engine). Read-only for the tests (copy it to change it): test_engine_modules,
    test_engines and test_onnxruntime_backend share it instead of exporting every engine each."""
    out = tmp_path_factory.mktemp("onnx-engines")
    proc = subprocess.run([sys.executable, "-m", "build_engines", "--preset", "tiny", "--format", "onnx", "--verify",
                           "--out", str(out)], capture_output=True, text=True, timeout=1200,
                          cwd=Path(__file__).resolve().parents[1])
    return SimpleNamespace(out=out, proc=proc)


@pytest.fixture
def no_model_load(request, monkeypatch):
    """The requesting test module's `LOAD_PIPELINE` (what its `_main` hands the CLI as the pipeline loader) fails the
    test if called: the CLI must refuse the input before it loads a model."""
    def boom(args):
        raise AssertionError("a model was loaded before the inputs were checked")

    monkeypatch.setattr(request.module, "LOAD_PIPELINE", boom)
