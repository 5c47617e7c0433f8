"""Prometheus metrics of one server (its own registry, served at GET /metrics)."""
from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.core import GaugeMetricFamily

# device -> {kind: bytes}, kind in MEMORY_KINDS; read at each scrape
MemoryReader = Callable[[], dict[str, dict[str, float]]]
MEMORY_KINDS = ("allocated", "reserved", "peak_allocated", "total")


def cuda_memory_reader(devices: Iterable[str]) -> MemoryReader:
    """The CUDA caching allocator's numbers of each CUDA device among `devices` (CPU devices have none):
    allocated, reserved, the peak allocated since start, and the device's total memory."""
    cuda = sorted({str(d) for d in devices if str(d).startswith("cuda")})

    def read() -> dict[str, dict[str, float]]:
        import torch

        return {d: {"allocated": torch.cuda.memory_allocated(d), "reserved": torch.cuda.memory_reserved(d),
                    "peak_allocated": torch.cuda.max_memory_allocated(d),
                    "total": torch.cuda.get_device_properties(d).total_memory} for d in cuda}

    return read


class _DeviceMemory:
    """A collector: sdvg_serve_device_memory_bytes{device, kind} read from the allocator at each scrape."""

    def __init__(self, read: MemoryReader):
        self.read = read

    def describe(self):
        return [GaugeMetricFamily("sdvg_serve_device_memory_bytes", "memory of each accelerator the pipeline "
                                  "runs on, by kind (allocated, reserved, peak_allocated, total)",
                                  labels=["device", "kind"])]

    def collect(self):
        family = self.describe()[0]
        for device, kinds in sorted(self.read().items()):
            for kind in MEMORY_KINDS:
                if kind in kinds:
                    family.add_metric([device, kind], float(kinds[kind]))
        yield family

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServeMetrics:
    """`build`: the server's build and model (label -> value) for sdvg_serve_build_info; `memory`: the device
    memory reader behind sdvg_serve_device_memory_bytes (`cuda_memory_reader` of the pipeline's devices)."""

    def __init__(self, build: dict[str, str] | None = None, memory: MemoryReader | None = None):
        r = self.registry = CollectorRegistry()
        self.build = Info("sdvg_serve_build", "sdvg, torch and sdvg._C as built, the preset and devices served",
                          registry=r)
        if build:
            self.build.info({k: str(v) for k, v in build.items()})
        if memory is not None:
            r.register(_DeviceMemory(memory))
        self.sessions_active = Gauge("sdvg_serve_sessions_active", "generations in progress", registry=r)
        self.sessions_queued = Gauge("sdvg_serve_sessions_queued", "sessions waiting for a slot", registry=r)
        self.sessions_total = Counter("sdvg_serve_sessions", "generations started (resets included)", registry=r)
        self.busy_total = Counter("sdvg_serve_busy_refusals", "sessions refused with busy", registry=r)
        self.blocks = Counter("sdvg_serve_blocks", "blocks emitted, by decision", ["decision"], registry=r)
        self.acceptance = Gauge("sdvg_serve_acceptance_ratio", "accepted share of blocks after block 0 (all "
                                "sessions since start)", registry=r)
        self.first_frame = Histogram("sdvg_serve_time_to_first_frame_seconds", "parameters received (or reset) "
                                     "to the first frame handed to the socket", buckets=LATENCY_BUCKETS, registry=r)
        self.block_latency = Histogram("sdvg_serve_block_latency_seconds", "the worker's time to make one block",
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.jitter = Histogram("sdvg_serve_inter_frame_jitter_seconds", "|change| of the interval between "
                                "consecutive blocks' frames reaching a socket (per session)",
                                buckets=LATENCY_BUCKETS, registry=r)
        self.loop_lag = Histogram("sdvg_serve_event_loop_lag_seconds", "how late the event loop woke a 0.1 s timer: "
                                  "how long one callback (a message decoded, a request parsed) held every socket",
                                  buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0), registry=r)
        self.loop_lag_max = Gauge("sdvg_serve_event_loop_lag_max_seconds", "the longest event-loop lag since start",
                                  registry=r)
        self.dropped = Counter("sdvg_serve_dropped_frames", "frames dropped from full send buffers (slow "
                               "clients); the MP4 keeps them", registry=r)
        self.stalled = Counter("sdvg_serve_stalled_clients", "sockets cut because one send waited --send-stall-s (the "
                               "client stopped reading); each one's session left the worker's rotation, its MP4 kept",
                               registry=r)
        self.uploads_receiving = Gauge("sdvg_serve_uploads_receiving", "uploads whose bodies are being received "
                                       "(each held in memory while read)", registry=r)
        self.uploads_held_bytes = Gauge("sdvg_serve_upload_bytes", "bytes of the uploads stored (and being "
                                        "written)", registry=r)
        self.refused = Counter("sdvg_serve_refused_messages", "client messages, connections and requests refused, "
                               "by reason", ["reason"],
                               registry=r)
        self.plain_adjusted = Counter("sdvg_serve_plain_adjusted", "what plain (Krea) clients sent that sdvg took "
                                      "otherwise than asked (ignored, capped, floored) or dropped without a reply, "
                                      "by reason", ["reason"], registry=r)
        self.plain_queued = Gauge("sdvg_serve_plain_sessions_queued", "plain (Krea) clients waiting for a slot, "
                                  "told nothing (Krea has no queue)", registry=r)
        self.round_sessions = Histogram("sdvg_serve_round_sessions", "sessions whose next blocks one round of the "
                                        "batched worker made together", buckets=(1, 2, 3, 4, 6, 8, 12, 16),
                                        registry=r)
        self.batched_calls = Counter("sdvg_serve_batched_calls", "model calls of the batched worker, by kind "
                                     "(denoise, commit, decode, score) and rows (sessions in the call)", ["kind", "rows"],
                                     registry=r)
        self.lane_seconds = Counter("sdvg_serve_lane_seconds", "seconds of the batched worker's model calls by lane "
                                    "(drafter, target, vae, reward): rate() is the lane's utilisation", ["lane"],
                                    registry=r)
        self.inter_block = Histogram("sdvg_serve_inter_block_seconds", "per session, the time between consecutive "
                                     "blocks' frames reaching the socket (p50 / p99 from the buckets)",
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.deadline_misses = Counter("sdvg_serve_deadline_misses", "blocks made after their session's playback had "
                                       "run dry (its frames so far played at the server's fps): the session fell "
                                       "behind", registry=r)
        self._later = self._accepted = 0

    def count_refused(self, reason: str) -> None:
        """One refusal (a message, a request, a connection) under `reason`."""
        self.refused.labels(reason).inc()

    def block(self, index: int, decision: str) -> None:
        self.blocks.labels(decision).inc()
        if index > 0 and decision in ("accepted", "rejected"):
            self._later += 1
            self._accepted += decision == "accepted"
            self.acceptance.set(self._accepted / self._later)

    def round(self, sessions: int, calls: dict | None = None, lane_seconds: dict | None = None) -> None:
        """One round of the batched worker: its sessions, the model calls it made ((kind, rows) -> count) and their
        seconds by lane (lane -> seconds)."""
        self.round_sessions.observe(sessions)
        for (kind, rows), count in (calls or {}).items():
            self.batched_calls.labels(kind, str(rows)).inc(count)
        for lane, seconds in (lane_seconds or {}).items():
            self.lane_seconds.labels(lane).inc(seconds)

    def text(self) -> bytes:
        return generate_latest(self.registry)
