"""How stages execute: `eager` (the modules as they are), `compile` (the static stage modules through
torch.compile) or `tensorrt` (engines from the engine cache, validated against this setup).

A `StageRunners` object is built once per pipeline and backend and holds the compiled modules or
engines explicitly; the loops call `dit_forward`, `decode` and `score` through it."""
from __future__ import annotations

from pathlib import Path

import torch

from sdvg.engines.stages import DiTStep, RewardStep, VAEDecodeStep, dit_forward_static, vae_cache_is_steady, \
    vae_decode_static

STAGE_BACKENDS = ("eager", "compile", "tensorrt")


class StageRunners:
    def __init__(self, comps, backend: str = "eager", engines: str | Path | None = None,
                 compile_mode: str | None = None):
        if backend not in STAGE_BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose one of {STAGE_BACKENDS}")
        self.comps, self.backend = comps, backend
        p = comps.preset
        self._tpf = {role: p.video.tokens_per_frame(p.vae, dit.config)
                     for role, dit in (("drafter", comps.drafter), ("target", comps.target)) if dit is not None}
        self._dit_steps: dict = {}
        self._vae_step = None
        self._reward_step = None
        if backend == "compile":
            for role, dit in (("drafter", comps.drafter), ("target", comps.target)):
                if dit is not None:
                    self._dit_steps[role] = torch.compile(DiTStep(dit).eval(), mode=compile_mode, dynamic=False)
            if comps.scorer is not None:
                self._reward_step = torch.compile(RewardStep(comps.scorer).eval(), mode=compile_mode, dynamic=False)
            self._compile_mode = compile_mode
        elif backend == "tensorrt":
            if engines is None:
                raise ValueError("backend 'tensorrt' needs engines=<folder built by python -m build_engines>")
            self._load_engines(Path(engines))

    # ------------------------------------------------------------------ DiT
    def dit_forward(self, role: str, dit, latents, timesteps, text, frame_offset: int, cache, attn_mask=None):
        step = self._dit_steps.get(role)
        if step is None:
            return dit(latents, timesteps, text, frame_offset=frame_offset, cache=cache, attn_mask=attn_mask)
        if attn_mask is not None:
            raise ValueError(f"backend {self.backend!r}: the static stages take no attention mask (a recompute "
                             "context forward); use backend 'eager'")
        return dit_forward_static(step, dit, latents, timesteps, text, frame_offset, cache, self._tpf[role])

    # ------------------------------------------------------------------ VAE
    def decode(self, latents, cache):
        dec = self.comps.vae
        if self.backend == "eager":
            return dec.decode(latents, cache)
        if self._vae_step is None:
            if not vae_cache_is_steady(cache):  # the steady-state step is built at the third latent frame
                first = 2 - cache.frames_decoded
                head = dec.decode(latents[:, :, :first], cache)
                return torch.cat([head, self.decode(latents[:, :, first:], cache)], dim=2) \
                    if latents.shape[2] > first else head
            step = VAEDecodeStep.for_cache(dec, cache).eval()
            self._vae_step = torch.compile(step, mode=self._compile_mode, dynamic=False)
        return vae_decode_static(self._vae_step, dec, latents, cache)

    # --------------------------------------------------------------- reward
    def score(self, prompt: str, unit_frames):
        sc = self.comps.scorer
        if self._reward_step is None:
            return sc.score(prompt, unit_frames)
        tok = sc.tokens(prompt)
        with torch.no_grad():
            return self._reward_step(sc.preprocess(unit_frames), tok.ids, tok.mask)

    # -------------------------------------------------------------- engines
    def _load_engines(self, folder: Path) -> None:
        from sdvg.engines.cache import EngineCache
        from sdvg.engines.signatures import dit_stage, reward_stage, stage_key, vae_stage
        from sdvg.engines.tensorrt import TRTStage, import_tensorrt

        import_tensorrt()
        cache = EngineCache(folder)
        p = self.comps.preset
        cmd = (f"python -m build_engines --preset {p.name} --drafter-device {self.comps.drafter_device} "
               f"--target-device {self.comps.target_device} --precision {p.precision} --out {folder}")
        for role in ("drafter", "target"):
            if getattr(self.comps, role) is None:
                continue
            spec = dit_stage(self.comps, role)
            plan = cache.load(stage_key(spec, p.precision, "tensorrt"), cmd)
            self._dit_steps[role] = TRTStage(plan, spec.device, spec.input_names)
        spec = vae_stage(self.comps)
        self._vae_step = TRTStage(cache.load(stage_key(spec, p.precision, "tensorrt"), cmd), spec.device,
                                  spec.input_names)
        if self.comps.scorer is not None:
            spec = reward_stage(self.comps)
            self._reward_step = TRTStage(cache.load(stage_key(spec, p.precision, "tensorrt"), cmd), spec.device,
                                         spec.input_names)
