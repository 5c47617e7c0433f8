"""`sdvg download`: every published component of a preset (or the ones a published repo gives it) into
the Hugging Face cache, with the sizes shown and the disk checked before anything is fetched;
resumable (the algorithm: `sdvg.models.download`)."""
from __future__ import annotations

import sys


def add_parser(sub, config: dict | None) -> None:
    d = sub.add_parser("download", help="fetch a preset's published weights into the Hugging Face cache (resumable)",
                       description="Fetch every component a preset loads (or those a published repo gives it) "
                                   "into the Hugging Face cache, so that `generate --preset NAME` and "
                                   "from_pretrained(NAME) then load offline. The files and their sizes are listed, "
                                   "and the disk checked, before anything is fetched; a rerun skips cached files "
                                   "and resumes an incomplete one.")
    d.add_argument("preset", metavar="PRESET",
                   help="a preset with published weights (wan2.1), or a repo one loads: org/name[@revision]")
    d.add_argument("--revision", help="branch, tag or commit of the one repo named (default: the preset's, main)")
    d.add_argument("--cache-dir", metavar="DIR",
                   help="the cache to fill (default: huggingface_hub's, HF_HUB_CACHE or HF_HOME/hub); load from it "
                        "with HF_HUB_CACHE=DIR or from_pretrained(..., cache_dir=DIR)")
    d.add_argument("--token", help="a Hugging Face access token for gated or private repos (default: HF_TOKEN, or "
                                   "the login of `hf auth login`)")
    d.add_argument("--dry-run", action="store_true",
                   help="list the files, their sizes and what is cached; fetch nothing")
    d.add_argument("--quiet", action="store_true", help="no progress bars")
    d.set_defaults(func=run)


def run(args, load_pipeline=None) -> int:
    """List, check, fetch; loads no model and imports no torch."""
    from sdvg.models.download import check_space, describe, fetch, plan, preset_sources, reaching_the_hub
    from sdvg.models.hub import HubAccess

    preset, sources = preset_sources(args.preset, args.revision)  # an unknown name: refused before the hub is asked
    access = HubAccess(cache_dir=args.cache_dir, token=args.token)  # HF_HUB_OFFLINE=1: refused by name
    with reaching_the_hub():
        plans = plan(sources, access)
    print("\n".join(describe(preset, plans, access)))
    if args.dry_run:
        return 0
    check_space(plans, access)
    with reaching_the_hub():
        fetch(plans, access, progress=not args.quiet)
    load = f"from_pretrained({preset!r}" + (f", cache_dir={args.cache_dir!r})" if args.cache_dir else ")")
    print(f"done: {load} and `sdvg generate --preset {preset}` now load offline"
          + (f" (the latter with HF_HUB_CACHE={args.cache_dir})" if args.cache_dir else ""), file=sys.stderr)
    return 0
