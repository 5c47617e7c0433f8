"""The prompts a command reads: prompt files (one prompt per line, UTF-8) and the selections the sweep
and the early-exit commands make from them; every error is a ValueError (exit 2) before any model loads."""
from __future__ import annotations

from pathlib import Path

from sdvg.io.text_input import check_prompt, read_prompts  # noqa: F401 (read_prompts: part of this module's API)

DEFAULT_PROMPTS = Path(__file__).resolve().parents[1] / "data" / "MovieGenVideoBench.txt"


def sweep_prompts(args) -> tuple[list[tuple[int, str]], dict]:
    """The selected (index, prompt) pairs of sweep / calibrate and what identifies them (file, sha256,
    counts)."""
    from sdvg.evaluation.sweep import sha256_file

    path = Path(args.prompts_file) if args.prompts_file else DEFAULT_PROMPTS
    if not path.is_file():
        raise ValueError(f"prompts file {path} not found; pass --prompts-file")
    prompts = read_prompts(path)
    selected = list(enumerate(prompts[: args.limit] if args.limit else prompts))
    if not selected:
        raise ValueError(f"no prompt selected from {path}")
    return selected, {"prompts_file": str(path), "prompts_sha256": sha256_file(path), "prompt_count": len(prompts),
                      "limit": args.limit}


def exit_prompts(args, extra: int = 0) -> tuple[list[str], dict]:
    """The prompts of calibrate-exit / train-exit-head: --prompt (repeatable) or --num-prompts (+ `extra`)
    lines of --prompts-file from --offset."""
    if getattr(args, "prompt", None):
        if args.prompts_file:
            raise ValueError("give either --prompt or --prompts-file")
        for p in args.prompt:
            check_prompt(p)
        return list(args.prompt), {"prompts": list(args.prompt)}
    from sdvg.evaluation.sweep import sha256_file

    path = Path(args.prompts_file) if args.prompts_file else DEFAULT_PROMPTS
    every = read_prompts(path)
    want = args.num_prompts + extra
    prompts = every[args.offset:args.offset + want]
    if len(prompts) < want:
        raise ValueError(f"{path} holds {len(every)} prompts: --offset {args.offset} leaves {len(prompts)}, "
                         f"{want} are needed")
    return prompts, {"prompts_file": str(path), "prompts_sha256": sha256_file(path), "offset": args.offset}
