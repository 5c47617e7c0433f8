"""The build of sdvg._C is said: a CPU-only core serving a CUDA device is a warning at load naming the fix,
and every run's statistics record the build. (The package built as the container builds it, CUDA asked
for with no GPU visible, is checked to be a CUDA build by tests/test_container.py.)"""
import dataclasses
import json
import warnings
from types import SimpleNamespace

import pytest
import torch

import sdvg._native as native
from sdvg.pipeline import SpeculativeVideoPipeline


def _fake_core(monkeypatch, cuda: bool):
    info = {"cuda": cuda, "torch_version": torch.__version__.split("+")[0]}
    if cuda:
        info["cuda_runtime_version"] = 13000
    monkeypatch.setattr(native, "_C", SimpleNamespace(build_info=lambda: dict(info)))


def _on_cuda(pipe):
    """The tiny pipeline's components, said to sit on cuda:0 (nothing moves: only the devices are read)."""
    return dataclasses.replace(pipe.components, drafter_device=torch.device("cuda:0"),
                               target_device=torch.device("cuda:1"))


def test_a_cpu_only_core_on_a_cuda_device_warns_at_load_naming_the_fix(tiny_pipe, monkeypatch):
    _fake_core(monkeypatch, cuda=False)
    with pytest.warns(RuntimeWarning, match=r"sdvg._C was built without CUDA .* runs on cuda:0, cuda:1: the native "
                                            r"scheduler runs every role on one stream.*SDVG_CUDA=1 pip install "
                                            r"--no-build-isolation \."):
        SpeculativeVideoPipeline(_on_cuda(tiny_pipe))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SpeculativeVideoPipeline(tiny_pipe.components)  # on the CPU a CPU build is what is wanted
        _fake_core(monkeypatch, cuda=True)
        SpeculativeVideoPipeline(_on_cuda(tiny_pipe))  # a CUDA build on CUDA devices: nothing to say


def test_moving_a_pipeline_to_cuda_with_a_cpu_only_core_warns(tiny_pipe, monkeypatch):
    _fake_core(monkeypatch, cuda=False)
    pipe = SpeculativeVideoPipeline(tiny_pipe.components)

    def move(device):  # what _move leaves behind, without a GPU to move to
        pipe.components = _on_cuda(pipe)

    monkeypatch.setattr(pipe, "_move", move)
    with pytest.warns(RuntimeWarning, match="sdvg._C was built without CUDA"):
        pipe.to("cuda:0")


def test_the_statistics_record_the_build(tiny_pipe):
    stats = tiny_pipe("a red fox", num_blocks=1).stats
    build = stats["run"]["build"]
    assert build == native.build_record() and set(build) == {"native_cuda", "native_cuda_runtime", "native_torch",
                                                             "torch_cuda"}
    assert build["native_cuda"] is native._C.build_info()["cuda"] and build["torch_cuda"] == torch.version.cuda
    assert build["native_torch"] == torch.__version__.split("+")[0] and stats["run"]["preset"] == "tiny"
    assert json.loads(stats.to_json())["run"]["build"] == build


def test_the_cuda_runtime_version_reads_as_major_minor(monkeypatch):
    _fake_core(monkeypatch, cuda=True)
    assert native.build_record()["native_cuda_runtime"] == "13.0"
    _fake_core(monkeypatch, cuda=False)
    assert native.build_record()["native_cuda_runtime"] is None
