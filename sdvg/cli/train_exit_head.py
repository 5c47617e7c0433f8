"""`sdvg train-exit-head`: train the learned exit verifier on oracle rollouts (resumable) and report its
held-out AUROC beside the stability verifier's; prints the flags that use the head (the algorithm:
`sdvg.evaluation.exit_head_training`)."""
from __future__ import annotations

from pathlib import Path

from sdvg.cli.args import count, real, say, seeds
from sdvg.cli.exit_args import add_exit_calibration_args, add_exit_config, bar_phase, base_options
from sdvg.cli.prompts import exit_prompts


def add_parser(sub, config: dict | None) -> None:
    te = add_exit_calibration_args(sub, "train-exit-head", "train the learned exit verifier on oracle rollouts "
                                                           "(docs/early-exit.md)")
    te.add_argument("--heldout-prompts", type=count(1), default=1,
                    help="prompts after the training ones, recorded with --heldout-seeds for the report (default: 1)")
    te.add_argument("--heldout-seeds", type=seeds, default="1", help="seeds of the held-out rollouts (not in --seeds)")
    te.add_argument("--steps", type=count(1), default=300, help="optimizer steps in all (default: 300)")
    te.add_argument("--batch-size", type=count(1), default=4, help="record rows per step (default: 4)")
    te.add_argument("--lr", type=real(0), default=1e-3, help="Adam's learning rate (default: 1e-3)")
    te.add_argument("--train-seed", type=count(0), default=0, help="the head's initial weights and batch draws")
    te.add_argument("--checkpoint-every", type=count(1), default=100, help="steps between checkpoints")
    te.add_argument("--out", default="results/exit-head", help="folder: head.safetensors, train.json, the "
                                                               "checkpoint and the recorded rollouts")
    te.add_argument("--resume", action="store_true", help="continue the checkpoint in --out (and reuse its "
                                                          "recorded rollouts when they match)")
    te.set_defaults(func=run)
    add_exit_config(te, config)


def run(args, load_pipeline) -> int:
    """Train the exit head on the hidden states and oracle gaps of recorded rollouts; report its AUROC on
    held-out rollouts beside the stability verifier's (docs/early-exit.md, "Training the head")."""
    from sdvg.evaluation.exit_calibration import TrainConfig, role_mode
    from sdvg.evaluation.exit_head_training import (HeadTrainingJob, check_heldout_seeds, check_out_folder,
                                                    folder_paths, train_exit_head)

    check_heldout_seeds(args.seeds, args.heldout_seeds)
    out = Path(args.out)
    check_out_folder(out)  # --out a folder, its files files: refused here, not after the model loads
    every, source = exit_prompts(args, extra=args.heldout_prompts)
    paths = folder_paths(out)
    if paths["checkpoint"].exists() and not args.resume:
        raise ValueError(f"{out} holds a training checkpoint; pass --resume to continue it or another --out")
    config = TrainConfig(args.steps, args.batch_size, args.lr, args.train_seed, args.checkpoint_every)
    base = base_options(args)
    job = HeadTrainingJob(every[:args.num_prompts], every[args.num_prompts:], args.seeds, args.heldout_seeds,
                          args.role, base, config, out, args.preset, args.resume)
    report = train_exit_head(load_pipeline(args), job, source, phase=bar_phase(args), say=lambda line: say(args, line))
    for st in report["heldout"]["steps"]:
        fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
        say(args, f"held-out k={st['k']}: AUROC head {fmt(st['head_auroc'])}, stability "
                  f"{fmt(st['stability_auroc'])} ({st['converged_share']:.1%} converged at eps {base.exit_eps:g})")
    say(args, f"loss {report['initial_loss']:.4f} -> {report['final_loss']:.4f}; head in {paths['head']}, report in "
              f"{paths['report']}")
    print(f"--mode {role_mode(args.role)} --early-exit {args.role} --exit-verifier head --exit-head {paths['head']} "
          f"--exit-eps {base.exit_eps!r}")
    return 0
