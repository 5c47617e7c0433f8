"""Training the learned exit verifier end to end (`sdvg train-exit-head`, docs/early-exit.md "Training
the head"): record training and held-out rollouts (reused from the folder when they match), train from a
fresh head or the folder's checkpoint, save the head, and report its held-out AUROC beside the
stability verifier's."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from sdvg.evaluation.calibration import collect_records, silent_phase

# The files of a training folder: what each holds.
FOLDER_FILES = (("records", "records.safetensors"), ("heldout", "heldout.safetensors"),
                ("checkpoint", "checkpoint.safetensors"), ("head", "head.safetensors"), ("report", "train.json"))


def folder_paths(out: Path) -> dict[str, Path]:
    """records / heldout (the rollouts), checkpoint, head and report (train.json) inside `out`."""
    return {name: Path(out) / file for name, file in FOLDER_FILES}


def check_out_folder(out: Path) -> None:
    """What the run will write, checked before any model loads or rollout runs (ValueError naming the path, what
    is there and the fix): `out` is a folder or nothing yet (then creatable: its nearest existing ancestor a
    folder), and each file of FOLDER_FILES there is a regular file or nothing (a folder at checkpoint.safetensors
    would otherwise be found at the first checkpoint, after the rollouts), its temporary name too."""
    import os
    import stat

    from sdvg.io.safe_files import kind_of, refuse_planted

    out = Path(out)
    what = ", ".join(file for _, file in FOLDER_FILES)
    try:
        mode = os.stat(out).st_mode
    except FileNotFoundError:
        mode = None
    except NotADirectoryError:
        mode = None
    except OSError as exc:
        raise ValueError(f"training folder {out} (--out) cannot be read ({exc.strerror}); give another --out") from None
    if mode is not None and not stat.S_ISDIR(mode):
        raise ValueError(f"training folder {out} (--out) is {kind_of(mode)}, not a folder: train-exit-head writes a folder "
                         f"there ({what}); give a folder's path, new or existing")
    if mode is None:
        parent = out.parent
        while not os.path.lexists(parent) and parent != parent.parent:
            parent = parent.parent
        if not parent.is_dir():
            raise ValueError(f"training folder {out} (--out) cannot be created: {parent} is not a folder; give another "
                             "--out")
        return
    for name, file in FOLDER_FILES:
        path = out / file
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            mode = None
        if mode is not None and not stat.S_ISREG(mode):
            raise ValueError(f"{path} is {kind_of(mode)}, not a file: train-exit-head writes its {name} there; remove it "
                             "or give another --out")
        refuse_planted(path.with_name(f".{file}.tmp"), f"the temporary file of {path}")


@dataclass(frozen=True)
class HeadTrainingJob:
    """What one training run records and trains on; `config` an `exit_calibration.TrainConfig`, `base`
    the generation options of the rollouts (mode, early exit and seed are set per rollout)."""
    train_prompts: list[str]
    heldout_prompts: list[str]
    seeds: list[int]
    heldout_seeds: list[int]
    role: str  # target | drafter: whose denoising loop is recorded
    base: object  # GenerationOptions
    config: object  # exit_calibration.TrainConfig
    out: Path  # the folder (FOLDER_FILES)
    preset: str  # the preset name, recorded with the head
    resume: bool = False  # continue the folder's checkpoint and reuse its matching rollouts

    def __post_init__(self):
        check_heldout_seeds(self.seeds, self.heldout_seeds)


def check_heldout_seeds(seeds: list[int], heldout_seeds: list[int]) -> None:
    """Held-out rollouts must use seeds the training rollouts do not."""
    if set(seeds) & set(heldout_seeds):
        raise ValueError(f"--heldout-seeds {heldout_seeds} share seeds with --seeds {seeds}; held-out "
                         "rollouts must use seeds not used in training")


def train_exit_head(pipe, job: HeadTrainingJob, source: dict | None = None, phase=silent_phase,
                    say: Callable[[str], None] = lambda line: None) -> dict:
    """Run `job` on `pipe`; writes the rollouts, the checkpoint, the head and train.json into `job.out`
    and returns the report (train.json's content; `source`, what identifies the prompts, recorded in it)."""
    from sdvg.evaluation import exit_calibration as ec
    from sdvg.generation.types import strict_json
    from sdvg.io.outputs import write_text_atomic

    check_out_folder(job.out)  # before the rollouts: a folder where a file goes is not found at the first save
    paths, config, base = folder_paths(job.out), job.config, job.base
    prov = pipe.provenance()
    generator = {"role": job.role, "preset": job.preset, "preset_fingerprint": prov["preset_fingerprint"],
                 "checkpoint": prov["checkpoints"].get(job.role)}
    Path(job.out).mkdir(parents=True, exist_ok=True)

    def records_for(name: str, prompts, seeds):
        meta = {"prompts": prompts, "seeds": seeds, "options": base.as_dict(), "generator": generator}
        if job.resume and paths[name].is_file():
            records, saved = ec.load_records(paths[name])
            if saved == json.loads(json.dumps(meta)):
                return records
            say(f"{paths[name]} was recorded for other prompts, seeds or options: recording again")
        records = collect_records(pipe, prompts, seeds, base, job.role, True, f"{name} rollouts", phase)
        ec.save_records(paths[name], records, meta)
        return records

    train_records = records_for("records", job.train_prompts, job.seeds)
    heldout = records_for("heldout", job.heldout_prompts, job.heldout_seeds)
    dim = int(train_records.hidden.shape[-1])
    resumed_from = None
    if job.resume and paths["checkpoint"].is_file():
        state, _ = ec.load_checkpoint(paths["checkpoint"], config, dim=dim)
        resumed_from = state.step
    else:
        state = ec.new_state(dim, config)
    initial_loss = ec.dataset_loss(ec.new_state(dim, config).head, train_records)
    with phase("train exit head", config.steps, "step", initial=state.step) as bar:
        def progress(step, loss):
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}")

        ec.train(state, train_records, config, progress,
                 checkpoint=lambda st: ec.save_checkpoint(paths["checkpoint"], st, config, {"generator": generator}))
    final_loss = ec.dataset_loss(state.head, train_records)
    state.head.save(paths["head"], extra={"training_prompts": len(job.train_prompts), "training_seeds": job.seeds,
                                          "steps": state.step, "final_loss": final_loss, "eps": base.exit_eps,
                                          "generator": generator})
    report = {"head": str(paths["head"]), "config": asdict(config), "role": job.role, "eps": base.exit_eps,
              "generator": generator, "parameters": state.head.num_parameters, "steps_done": state.step,
              "resumed_from": resumed_from, "initial_loss": initial_loss, "final_loss": final_loss,
              "loss_first_batches": state.losses[:10], "loss_last_batches": state.losses[-10:],
              "train": {"prompts": len(job.train_prompts), "seeds": job.seeds, "rows": len(train_records)},
              "heldout": {"prompts": len(job.heldout_prompts), "seeds": job.heldout_seeds, "rows": len(heldout),
                          **ec.evaluate_head(state.head, heldout, base.exit_eps)},
              **(source or {}), "options": base.as_dict()}
    write_text_atomic(paths["report"], strict_json(report, indent=2))
    return report
