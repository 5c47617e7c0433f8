"""The server's build-info and device-memory metrics: sdvg_serve_build_info names sdvg, torch, sdvg._C's build,
the preset and devices; sdvg_serve_device_memory_bytes reads each CUDA device's allocator at every scrape and
has no sample on the CPU."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("prometheus_client", reason="the serve extra (prometheus-client) is not installed")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from sdvg.serve.metrics import ServeMetrics, cuda_memory_reader  # noqa: E402


def _samples(metrics: ServeMetrics, name: str) -> list:
    return [s for f in text_string_to_metric_families(metrics.text().decode()) for s in f.samples if s.name == name]


def test_build_info_names_the_build_preset_and_devices(tiny_pipe):
    from sdvg.serve.engine import build_labels, pipe_devices

    labels = build_labels(tiny_pipe)
    metrics = ServeMetrics(labels, cuda_memory_reader(pipe_devices(tiny_pipe)))
    (sample,) = _samples(metrics, "sdvg_serve_build_info")
    assert sample.value == 1.0
    import sdvg

    got = sample.labels
    assert got["preset"] == "tiny" and got["sdvg_version"] == sdvg.__version__ and got["torch_version"] == \
        torch.__version__
    assert got["native_cuda"] in ("true", "false") and got["native_torch"] and got["target_device"] == "cpu"
    assert _samples(metrics, "sdvg_serve_device_memory_bytes") == []  # a CPU pipeline: no device memory


def test_device_memory_is_read_from_each_cuda_device_at_every_scrape(monkeypatch):
    """The reader asks the allocator of each CUDA device (by its name) and nothing for the CPU; a stand-in for
    torch.cuda's functions records the device each call names, so a wrong device cannot pass."""
    asked, scale = [], [1]

    def fake(kind):
        def read(device):
            asked.append((kind, str(device)))
            return {"cuda:0": 100, "cuda:1": 200}[str(device)] * scale[0] + {"a": 0, "r": 1, "p": 2}[kind]
        return read

    class Props:
        def __init__(self, d):
            self.total_memory = {"cuda:0": 1000, "cuda:1": 2000}[str(d)]

    monkeypatch.setattr(torch.cuda, "memory_allocated", fake("a"))
    monkeypatch.setattr(torch.cuda, "memory_reserved", fake("r"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", fake("p"))
    monkeypatch.setattr(torch.cuda, "get_device_properties", Props)
    metrics = ServeMetrics({"preset": "x"}, cuda_memory_reader(["cpu", "cuda:1", "cuda:0", "cuda:1"]))
    first = {(s.labels["device"], s.labels["kind"]): s.value for s in _samples(metrics, "sdvg_serve_device_memory_bytes")}
    assert first == {("cuda:0", "allocated"): 100, ("cuda:0", "reserved"): 101, ("cuda:0", "peak_allocated"): 102,
                     ("cuda:0", "total"): 1000, ("cuda:1", "allocated"): 200, ("cuda:1", "reserved"): 201,
                     ("cuda:1", "peak_allocated"): 202, ("cuda:1", "total"): 2000}
    assert {d for _, d in asked} == {"cuda:0", "cuda:1"}  # never the CPU
    scale[0] = 3  # read again at the next scrape, not cached
    again = {(s.labels["device"], s.labels["kind"]): s.value for s in _samples(metrics, "sdvg_serve_device_memory_bytes")}
    assert again[("cuda:1", "allocated")] == 600 and again[("cuda:0", "total")] == 1000
