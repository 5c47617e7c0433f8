"""The calibration algorithms called directly (no command line): the stability thresholds of
`calibrate_exit_thresholds` and the exit-head training job, on the tiny random-weight pipeline."""
import dataclasses
import json
from contextlib import contextmanager

import pytest

from sdvg import GenerationOptions
from sdvg.evaluation import exit_calibration as ec
from sdvg.evaluation.calibration import calibrate_exit_thresholds
from sdvg.evaluation.exit_head_training import HeadTrainingJob, folder_paths, train_exit_head

BASE = GenerationOptions(num_blocks=2, scheduler="reference", exit_eps=1.5)


class _Phases:
    """A `phase` that records every bar it opens and the ticks each got."""

    def __init__(self):
        self.opened = []  # [desc, total, unit, initial, ticks]

    @contextmanager
    def __call__(self, desc, total, unit, initial=0):
        entry = [desc, total, unit, initial, 0]
        self.opened.append(entry)

        class Bar:
            def update(self, n=1):
                entry[4] += n

            def set_postfix(self, **values):
                pass

        yield Bar()


@pytest.mark.slow
def test_calibrate_exit_thresholds_reports_the_flags_and_the_measured_k_bar(tiny_pipe):
    phases = _Phases()
    res = calibrate_exit_thresholds(tiny_pipe, ["a cat on a wall"], [0, 1], BASE, "target", 0.6, "precision",
                                    source={"prompts": ["a cat on a wall"]}, phase=phases)
    red, stab = res["thresholds"]
    assert res["flags"] == (f"--mode target --early-exit target --exit-verifier stability --exit-thresholds "
                            f"{red!r},{stab!r}")
    assert res["role"] == "target" and res["eps"] == 1.5 and res["seeds"] == [0, 1] and res["prompt_count"] == 1
    assert res["prompts"] == ["a cat on a wall"] and res["provenance"] == tiny_pipe.provenance()
    assert res["options"]["mode"] == "target" and res["options"]["early_exit"] == "target"
    assert len(res["measured_per_video"]) == 2 and 1.0 <= res["measured_mean_steps"] <= res["num_steps"]
    assert [(p[0], p[1], p[4]) for p in phases.opened] == [("oracle rollouts", 2, 2),
                                                           ("generate with the thresholds", 2, 2)]


def test_head_training_job_refuses_shared_seeds():
    with pytest.raises(ValueError) as e:
        HeadTrainingJob(["a"], ["b"], [0, 1], [1], "target", BASE, ec.TrainConfig(), None, "tiny")
    assert all(s in str(e.value) for s in ("--heldout-seeds [1]", "not used in training")), e.value


@pytest.mark.slow
def test_train_exit_head_writes_the_folder_and_resumes_to_the_same_head(tiny_pipe, tmp_path):
    import torch
    from safetensors.torch import load_file

    config = ec.TrainConfig(steps=6, batch_size=2, checkpoint_every=3)
    job = HeadTrainingJob(["a cat on a wall"], ["a red bird"], [0], [5], "target", BASE, config, tmp_path / "full",
                          "tiny")
    phases, said = _Phases(), []
    report = train_exit_head(tiny_pipe, job, {"prompts_file": "p.txt"}, phase=phases, say=said.append)
    paths = folder_paths(job.out)
    assert all(p.is_file() for p in paths.values())
    assert json.loads(paths["report"].read_text()) == json.loads(json.dumps(report))
    assert report["steps_done"] == 6 and report["resumed_from"] is None and report["prompts_file"] == "p.txt"
    assert report["generator"]["role"] == "target" and report["generator"]["preset"] == "tiny"
    assert report["train"]["rows"] > 0 and report["heldout"]["seeds"] == [5] and report["options"] == BASE.as_dict()
    assert [p[0] for p in phases.opened] == ["records rollouts", "heldout rollouts", "train exit head"]
    assert phases.opened[-1][4] == 6 and not said

    # the same job stopped at step 3, then resumed: the recorded rollouts are reused, the head is the same
    half = tmp_path / "half"
    half.mkdir()
    for name in ("records", "heldout"):
        (half / paths[name].name).write_bytes(paths[name].read_bytes())
    short = HeadTrainingJob(job.train_prompts, job.heldout_prompts, [0], [5], "target", BASE,
                            ec.TrainConfig(steps=3, batch_size=2, checkpoint_every=3), half, "tiny", resume=True)
    phases = _Phases()
    assert train_exit_head(tiny_pipe, short, phase=phases)["steps_done"] == 3
    resumed = train_exit_head(tiny_pipe, dataclasses.replace(job, out=half, resume=True))
    assert [p[0] for p in phases.opened] == ["train exit head"]  # no rollout recorded again
    assert resumed["resumed_from"] == 3 and resumed["steps_done"] == 6
    full_head, half_head = load_file(paths["head"]), load_file(folder_paths(half)["head"])
    assert all(torch.equal(full_head[k], half_head[k]) for k in full_head)
