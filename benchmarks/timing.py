"""Timing shared by the benchmarks: device synchronised around each measurement, CUDA events on a
GPU, perf_counter on the CPU, warm-up excluded, median of repeats."""
from __future__ import annotations

import statistics
import time

import torch


def median_seconds(fn, device: torch.device, repeats: int, warmup: int = 1) -> float:
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            out.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(out)
