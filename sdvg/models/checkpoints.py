"""Checkpoint reading and strict loading for the Wan DiT.

Formats: Self-Forcing `.pt` (dict with `generator_ema`/`generator`, keys prefixed `model.`),
Krea-style `.safetensors` (prefix `model.`), original Wan keys (`blocks.N.self_attn.q.weight`),
and diffusers folders (config.json + diffusion_pytorch_model*.safetensors). Files are read with
safetensors or `torch.load(weights_only=True)`; nothing else is ever unpickled.

Every tensor a loader takes from a file is checked as it is read (`check_weights`): a floating dtype
(an int8 tensor would otherwise be cast to float silently) and finite values (one `sum` per tensor
when it is clean, a count when it is not). Errors name the file and the file's own key names.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch


class CheckpointError(ValueError):
    """A checkpoint cannot be read or does not fit the model; the message says which key and why."""


# ------------------------------------------------------------------ key names
_TOP = {  # original Wan module -> diffusers module
    "patch_embedding": "patch_embedding",
    "text_embedding.0": "condition_embedder.text_embedder.linear_1",
    "text_embedding.2": "condition_embedder.text_embedder.linear_2",
    "time_embedding.0": "condition_embedder.time_embedder.linear_1",
    "time_embedding.2": "condition_embedder.time_embedder.linear_2",
    "time_projection.1": "condition_embedder.time_proj",
    "head.head": "proj_out",
    "head.modulation": "scale_shift_table",
}
_BLOCK = {
    "norm3": "norm2",  # the affine cross-attention norm
    "ffn.0": "ffn.net.0.proj",
    "ffn.2": "ffn.net.2",
    "modulation": "scale_shift_table",
}
for _orig, _diff in (("self_attn", "attn1"), ("cross_attn", "attn2")):
    _BLOCK.update({f"{_orig}.q": f"{_diff}.to_q", f"{_orig}.k": f"{_diff}.to_k", f"{_orig}.v": f"{_diff}.to_v",
                   f"{_orig}.o": f"{_diff}.to_out.0", f"{_orig}.norm_q": f"{_diff}.norm_q",
                   f"{_orig}.norm_k": f"{_diff}.norm_k"})
_TOP_INV = {v: k for k, v in _TOP.items()}
_BLOCK_INV = {v: k for k, v in _BLOCK.items()}
_BLOCK_RE = re.compile(r"^blocks\.(\d+)\.(.+)$")
_PARAM_SUFFIXES = (".weight", ".bias")


def _rename(key: str, top: dict, block: dict) -> str | None:
    m = _BLOCK_RE.match(key)
    prefix, rest, table = "", key, top
    if m:
        prefix, rest, table = f"blocks.{m.group(1)}.", m.group(2), block
    if rest in table:  # parameters without a .weight/.bias suffix (modulation tables)
        return prefix + table[rest]
    for suffix in _PARAM_SUFFIXES:
        if rest.endswith(suffix) and rest[: -len(suffix)] in table:
            return prefix + table[rest[: -len(suffix)]] + suffix
    return None


def original_to_diffusers(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in state.items():
        new = _rename(k, _TOP, _BLOCK)
        if new is None:
            raise CheckpointError(f"unexpected key {k!r} in an original-format Wan checkpoint")
        out[new] = v
    return out


def diffusers_to_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in state.items():
        new = _rename(k, _TOP_INV, _BLOCK_INV)
        if new is None:
            raise CheckpointError(f"key {k!r} has no original Wan name")
        out[new] = v
    return out


# ------------------------------------------------------------------- values
_COUNT_CHUNK = 1 << 24  # elements per step of the NaN/inf count (bounded extra memory on a bad tensor)
_SHOWN = 3  # bad keys named in an error (the count names the rest)
FIX = "re-download / re-export the checkpoint"


def nonfinite_counts(t: torch.Tensor) -> tuple[int, int]:
    """(NaN count, inf count) of a floating tensor. A clean tensor costs one `sum` (NaN and inf
    propagate through a sum; on the CPU it runs ~10x faster than `isfinite().all()`); only when the
    sum is not finite (a bad value, or an overflow of finite ones) are the values counted, in chunks.
    The result is a Python int: on CUDA this synchronises with the tensor's stream."""
    if t.numel() == 0:
        return 0, 0
    try:
        if bool(torch.isfinite(t.sum())):
            return 0, 0
    except (RuntimeError, NotImplementedError):  # a dtype without a sum kernel here (float8): count
        pass
    nan = inf = 0
    for chunk in t.reshape(-1).split(_COUNT_CHUNK):
        if chunk.dtype not in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
            chunk = chunk.float()
        nan += int(torch.isnan(chunk).sum())
        inf += int(torch.isinf(chunk).sum())
    return nan, inf


def tensor_problem(t: torch.Tensor) -> str | None:
    """What makes a tensor unusable as weights (None: nothing): a non-floating dtype or non-finite values."""
    if not t.is_floating_point():
        return f"dtype {t.dtype}, not a floating dtype (it would be cast to float silently)"
    nan, inf = nonfinite_counts(t)
    if nan or inf:
        return f"non-finite values ({nan} NaN, {inf} inf)"
    return None


def _raise_problems(source, problems: list[tuple[str, str]]) -> None:
    if not problems:
        return
    shown = "; ".join(f"{k!r}: {why}" for k, why in problems[:_SHOWN])
    more = f"; and {len(problems) - _SHOWN} more" if len(problems) > _SHOWN else ""
    raise CheckpointError(f"{source}: {len(problems)} unusable tensor(s): {shown}{more}. The file is damaged or "
                          f"was exported wrongly; {FIX}")


def check_weights(state: dict[str, torch.Tensor], source) -> None:
    """Refuse a state dict read from `source` that holds a non-floating tensor or a NaN/inf, naming the
    first keys (as the file spells them) and how many there are. One pass over every tensor."""
    _raise_problems(source, [(k, why) for k, t in state.items()
                             if isinstance(t, torch.Tensor) and (why := tensor_problem(t)) is not None])


def check_module_weights(module: torch.nn.Module, source) -> None:
    """`check_weights` for a module another library loaded (its parameter and buffer names)."""
    _raise_problems(source, [(k, why) for k, t in module.state_dict().items()
                             if t.is_floating_point() and (why := tensor_problem(t)) is not None])


def _is_float_tag(tag: str) -> bool:
    return tag.startswith(("F", "BF"))  # safetensors: F16, BF16, F32, F64, F8_E4M3, ...; I8, U8, BOOL, ...


def check_file_dtypes(files) -> None:
    """Refuse weight files that hold a non-floating tensor, reading only their headers (`.safetensors`)
    or a memory map (`torch.load(mmap=True)`), for loaders that cast to float as they read."""
    for f in files:
        f = Path(f)
        if f.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(f), "pt") as h:
                bad = [(k, f"dtype {tag}, not a floating dtype (it would be cast to float silently)")
                       for k in h.keys() if not _is_float_tag(tag := h.get_slice(k).get_dtype())]
        else:
            state = _unwrap(_read_file(f), str(f))
            bad = [(k, f"dtype {t.dtype}, not a floating dtype (it would be cast to float silently)")
                   for k, t in state.items() if not t.is_floating_point()]
        _raise_problems(f, bad)


# ------------------------------------------------------------------- reading
def _read_file(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} does not exist")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        if path.suffix in (".pt", ".pth", ".bin", ".ckpt"):
            import zipfile

            # torch.save's zip format is memory-mapped; the legacy (pre-1.6) format cannot be, so it is read
            # whole, still with weights_only (no arbitrary objects either way)
            obj = torch.load(str(path), map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
        else:
            raise CheckpointError(f"{path}: unknown checkpoint extension {path.suffix!r} (.safetensors, .pt, .pth)")
    except CheckpointError:
        raise
    except Exception as exc:  # corrupt or truncated file, or a pickle with arbitrary objects
        raise CheckpointError(f"cannot read {path}: {type(exc).__name__}: {exc}. The file is corrupt, truncated, "
                              "or holds objects other than tensors (only weights are loaded)") from exc
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path} holds a {type(obj).__name__}, not a dict of tensors")
    return obj


def read_checked_files(files: list[Path]) -> dict[str, torch.Tensor]:
    """The tensors of several weight files (the shards of a folder), each file checked as it is read."""
    state: dict[str, torch.Tensor] = {}
    for f in files:
        part = _read_file(f)
        check_weights(part, f)
        state.update(part)
    return state


def _read_sharded(index: Path) -> dict[str, torch.Tensor]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except Exception as exc:
        raise CheckpointError(f"{index} is not a valid shard index: {exc}") from exc
    state = {}
    for shard in sorted(set(weight_map.values())):
        part = _read_file(index.parent / shard)
        check_weights(part, index.parent / shard)
        state.update(part)
    return state


def _unwrap(obj: dict, source: str) -> dict[str, torch.Tensor]:
    """Self-Forcing checkpoints nest the weights under generator_ema (preferred) or generator."""
    for key in ("generator_ema", "generator", "state_dict", "model_state_dict"):
        if key in obj and isinstance(obj[key], dict):
            obj = obj[key]
            break
    bad = [k for k, v in obj.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointError(f"{source}: entries {bad[:5]} are not tensors; not a weights checkpoint")
    return obj


def _strip_prefix(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    for prefix in ("model.diffusion_model.", "model.", "transformer."):
        if state and all(k.startswith(prefix) for k in state):
            return {k[len(prefix):]: v for k, v in state.items()}
    return state


def is_original_format(state: dict[str, torch.Tensor]) -> bool:
    return any(".self_attn." in k or k.startswith("head.") for k in state)


def read_dit_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict | None]:
    """Any supported DiT checkpoint -> (diffusers-named state dict, diffusers config or None)."""
    path = Path(path)
    config = None
    if path.is_dir():
        folder = path / "transformer" if (path / "transformer" / "config.json").is_file() else path
        cfg_file = folder / "config.json"
        if not cfg_file.is_file():
            raise CheckpointError(f"{path} is a folder without config.json; not a diffusers model folder")
        config = json.loads(cfg_file.read_text())
        index = sorted(folder.glob("*.safetensors.index.json"))
        files = sorted(folder.glob("*.safetensors"))
        if index:
            state = _read_sharded(index[0])
        elif files:
            state = read_checked_files(files)
        else:
            raise CheckpointError(f"{folder} holds no .safetensors weights")
        state = _unwrap(state, str(path))
    elif path.name.endswith(".index.json"):
        state = _unwrap(_read_sharded(path), str(path))
    else:
        state = _unwrap(_read_file(path), str(path))
        check_weights(state, path)  # the file's own key names (generator_ema's, for Self-Forcing)
    state = _strip_prefix(state)
    if is_original_format(state):
        state = original_to_diffusers(state)
    return state, config


def _mismatches(own_shapes: dict, state: dict[str, torch.Tensor], source: str, describe_size=None) -> None:
    missing = sorted(set(own_shapes) - set(state))
    unexpected = sorted(set(state) - set(own_shapes))
    mismatched = [(k, own_shapes[k], tuple(state[k].shape)) for k in own_shapes
                  if k in state and own_shapes[k] != tuple(state[k].shape)]
    problems = []
    if mismatched:
        k, want, got = mismatched[0]
        hint = f" ({describe_size})" if describe_size else ""
        problems.append(f"{len(mismatched)} shape mismatch(es), first {k!r}: expected {list(want)}, found "
                        f"{list(got)}; the checkpoint is for a different model size{hint}")
    if missing:
        problems.append(f"{len(missing)} missing key(s), e.g. {missing[:3]}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected key(s), e.g. {unexpected[:3]}")
    if problems:
        raise CheckpointError(f"{source} does not match the model: " + "; ".join(problems))


def load_strict(module: torch.nn.Module, state: dict[str, torch.Tensor], source: str,
                describe_size=None) -> None:
    """Copy `state` into `module`, refusing missing, unexpected and mis-shaped keys, and a non-floating
    tensor for a floating parameter (the values were checked when the file was read: `check_weights`)."""
    own = module.state_dict()
    _mismatches({k: tuple(v.shape) for k, v in own.items()}, state, source, describe_size)
    _raise_problems(source, [(k, f"dtype {state[k].dtype}, not a floating dtype (it would be cast to float "
                                 "silently)") for k, t in own.items()
                             if t.is_floating_point() and not state[k].is_floating_point()])
    with torch.no_grad():
        for k, t in own.items():
            t.copy_(state[k].to(t.dtype))


def _size_hint(cfg) -> str:
    return f"model has dim {cfg.dim}, {cfg.num_layers} layers, ffn {cfg.ffn_dim}"


def check_dit_checkpoint(path: str | Path, cfg) -> tuple[dict[str, torch.Tensor], dict | None]:
    """Read a DiT checkpoint and check it against `cfg` before any model is allocated (the reference
    shapes come from a model on the meta device). Returns what `load_dit` needs."""
    from diffusers import WanTransformer3DModel

    state, config = read_dit_checkpoint(path)
    if config is not None:
        want = cfg.diffusers_kwargs()
        for key in ("num_attention_heads", "attention_head_dim", "num_layers", "ffn_dim", "text_dim"):
            if key in config and config[key] != want[key]:
                raise CheckpointError(f"{path}: config {key}={config[key]} but the model expects {want[key]}; the "
                                      "checkpoint is for a different model size than the preset")
    with torch.device("meta"):
        ref = WanTransformer3DModel(**cfg.diffusers_kwargs())
    _mismatches({k: tuple(v.shape) for k, v in ref.state_dict().items()}, state, str(path), _size_hint(cfg))
    return state, config


def load_dit(dit, path: str | Path, checked: tuple | None = None) -> None:
    """Load any supported checkpoint into a `CausalWanDiT`, strictly (`checked`: the result of
    `check_dit_checkpoint`, to avoid reading the file twice)."""
    state, _ = checked if checked is not None else check_dit_checkpoint(path, dit.config)
    load_strict(dit.model, state, str(path), describe_size=_size_hint(dit.config))


def save_dit(dit, path: str | Path, fmt: str = "diffusers") -> None:
    """Write a DiT in one of the supported formats: diffusers | original | self-forcing | krea."""
    from safetensors.torch import save_file

    path = Path(path)
    state = {k: v.detach().contiguous().cpu() for k, v in dit.model.state_dict().items()}
    if fmt == "diffusers":
        path.mkdir(parents=True, exist_ok=True)
        save_file(state, str(path / "diffusion_pytorch_model.safetensors"))
        cfg = dict(dit.config.diffusers_kwargs(), _class_name="WanTransformer3DModel")
        cfg["patch_size"] = list(cfg["patch_size"])
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
    elif fmt == "original":
        save_file(diffusers_to_original(state), str(path))
    elif fmt == "krea":
        save_file({"model." + k: v for k, v in diffusers_to_original(state).items()}, str(path))
    elif fmt == "self-forcing":
        orig = {"model." + k: v for k, v in diffusers_to_original(state).items()}
        torch.save({"generator_ema": orig, "generator": orig}, str(path))
    else:
        raise ValueError(f"unknown checkpoint format {fmt!r}: diffusers | original | self-forcing | krea")
