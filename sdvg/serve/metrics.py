"""Prometheus metrics of one server (its own registry, served at GET /metrics)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServeMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
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
        self.dropped = Counter("sdvg_serve_dropped_frames", "frames dropped from full send buffers (slow "
                               "clients); the MP4 keeps them", registry=r)
        self.uploads_receiving = Gauge("sdvg_serve_uploads_receiving", "uploads whose bodies are being received "
                                       "(each held in memory while read)", registry=r)
        self.uploads_held_bytes = Gauge("sdvg_serve_upload_bytes", "bytes of the uploads stored (and being "
                                        "written)", registry=r)
        self.refused = Counter("sdvg_serve_refused_messages", "client messages refused, by reason", ["reason"],
                               registry=r)
        self.plain_adjusted = Counter("sdvg_serve_plain_adjusted", "what plain (Krea) clients sent that sdvg took "
                                      "otherwise than asked (ignored, capped, floored) or dropped without a reply, "
                                      "by reason", ["reason"], registry=r)
        self.plain_queued = Gauge("sdvg_serve_plain_sessions_queued", "plain (Krea) clients waiting for a slot, "
                                  "told nothing (Krea has no queue)", registry=r)
        self._later = self._accepted = 0

    def block(self, index: int, decision: str) -> None:
        self.blocks.labels(decision).inc()
        if index > 0 and decision in ("accepted", "rejected"):
            self._later += 1
            self._accepted += decision == "accepted"
            self.acceptance.set(self._accepted / self._later)

    def text(self) -> bytes:
        return generate_latest(self.registry)
