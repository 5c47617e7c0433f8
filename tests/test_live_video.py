"""Live sessions over whole (tiny) videos: no update equals pipe(...), a session updated from another
thread equals the batch run of its recorded schedule, bitwise; a bad update loses nothing (docs/live.md)."""
import threading

import pytest
import torch

from sdvg.live.updates import UpdateError

pytestmark = pytest.mark.slow
KW = dict(scheduler="reference", seed=5, tau=-0.7)


def _video(blocks):
    return torch.cat([b.latents for b in blocks], dim=2), torch.cat([b.frames for b in blocks])


@pytest.mark.parametrize("run", [{}, {"scheduler": "cpp"}, {"scheduler": "cpp", "run_ahead": True}],
                         ids=["reference", "cpp", "cpp-run-ahead"])
def test_a_session_without_updates_equals_pipe_bitwise(tiny_pipe, run):
    out = tiny_pipe("a red fox", num_blocks=3, output_type="uint8", **{**KW, **run})
    session = tiny_pipe.session("a red fox", num_blocks=3, **{**KW, **run})
    blocks = list(session)
    latents, frames = _video(blocks)
    assert torch.equal(latents, out.latents) and torch.equal(frames, out.frames[0])  # one prompt: a batch of one
    assert [b.decision for b in blocks] == [b.decision for b in out.blocks[0]]
    stats = session.stats.as_dict()
    assert stats["live"]["updates"] == [] and stats["live"]["segments"] == 1 and stats["live"]["prompt_encodes"] == 1
    assert [b["live"]["block"] for b in stats["blocks"]] == [0, 1, 2] and not stats["video"]["interrupted"]


def test_updates_from_another_thread_replay_bitwise_from_the_recorded_schedule(tiny_pipe):
    session = tiny_pipe.session("a red fox", num_blocks=6, interp_blocks=2, **KW)
    emitted = [threading.Event() for _ in range(6)]
    acks, errors = [], []

    def send():  # each update once block k is out: it takes effect at block k + 1
        try:
            emitted[0].wait(60)
            acks.append(session.update(prompt="an owl at night"))  # blended over 2 blocks
            emitted[2].wait(60)
            acks.append(session.update(seed=11, prompt="a cat"))  # restart: new seed, block 0 forced again
            emitted[3].wait(60)
            acks.append(session.update(tau=float("-inf")))
            acks.append(session.update(prompt="a red fox", interp_blocks=1))  # at once
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    sender = threading.Thread(target=send)
    sender.start()
    blocks = []
    for b in session:
        blocks.append(b)
        emitted[b.live["block"]].set()
        if b.live["block"] in (0, 2, 3):
            sender.join(0.0)
            while (len(acks) < {0: 1, 2: 2, 3: 4}[b.live["block"]]) and not errors:
                sender.join(0.05)  # the consumer waits for the update before asking for the next block
    sender.join()
    assert not errors
    assert [a.block for a in acks] == [1, 3, 4, 4]
    stats = session.stats.as_dict()
    assert stats["live"]["updates"] == [{"block": 1, "prompt": "an owl at night"}, {"block": 3, "prompt": "a cat", "seed": 11},
                                {"block": 4, "tau": float("-inf")}, {"block": 4, "prompt": "a red fox", "interp_blocks": 1}]
    live = [b.live for b in blocks]
    assert [x["blend_weight"] for x in live] == [1.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    assert [x["prompt_index"] for x in live] == [0, 1, 1, 2, 0, 0]
    assert [x["segment"] for x in live] == [0, 0, 0, 1, 1, 1] and [b.index for b in blocks] == [0, 1, 2, 0, 1, 2]
    assert [b.decision for b in blocks][2:4] == ["forced", "forced"] and live[2]["forced_by_update"]
    assert live[4]["forced_by_update"] and blocks[5].decision == "accepted"  # tau = -inf from block 4 on
    assert stats["live"]["prompt_encodes"] == 3 and stats["live"]["segments"] == 2

    replay = tiny_pipe(prompt_schedule=[(0, "a red fox")] + stats["live"]["updates"], num_blocks=6, interp_blocks=2,
                       output_type="uint8", **KW)
    latents, frames = _video(blocks)
    assert torch.equal(latents, replay.latents) and torch.equal(frames, replay.frames[0])
    assert [b.live for b in replay.blocks[0]] == live
    assert replay.stats.as_dict()["live"]["updates"] == stats["live"]["updates"]


def test_a_bad_update_mid_session_loses_no_block(tiny_pipe):
    out = tiny_pipe("a red fox", num_blocks=3, output_type="uint8", **KW)
    session = tiny_pipe.session("a red fox", num_blocks=3, **KW)
    blocks = [next(session)]
    for bad in (dict(prompt=""), dict(prompt="x", interp_blocks=0), dict(seed="7")):
        with pytest.raises(UpdateError):
            session.update(**bad)
    blocks += list(session)
    latents, frames = _video(blocks)
    assert torch.equal(latents, out.latents) and torch.equal(frames, out.frames[0])
    assert session.stats.as_dict()["live"]["updates"] == []


def test_close_from_another_thread_ends_after_the_block_in_progress(tiny_pipe):
    session = tiny_pipe.session("a red fox", num_blocks=None, window_frames=6, sink_frames=3, **KW)
    blocks = []
    for b in session:
        blocks.append(b)
        if len(blocks) == 2:
            closer = threading.Thread(target=session.close)
            closer.start()
            closer.join(60)  # closed from another thread, between two blocks
            assert not closer.is_alive()
    assert len(blocks) == 2 and session.finished
    assert session.stats.as_dict()["live"]["blocks_started"] == 2
    with pytest.raises(RuntimeError, match="closed"):
        session.update(prompt="an owl")


@pytest.mark.parametrize("run", [{}, {"scheduler": "cpp", "run_ahead": True, "drafter_context": "committed"},
                                 {"scheduler": "cpp", "run_ahead": True, "drafter_context": "own"}],
                         ids=["reference", "cpp-run-ahead-committed", "cpp-run-ahead-own"])
def test_every_stage_sees_its_blocks_own_conditioning(tiny_pipe, monkeypatch, run):
    """For every drafter and target denoise (every draft of a block under run-ahead, redrafts too), the text K/V
    it used equals the DiT's encoding of Krea's blend for that block, computed here independently from the
    prompts' embeddings: no block is drafted under a conditioning other than its own."""
    from sdvg.generation.role_model import RoleModel

    seen = []
    denoise = RoleModel.denoise

    def recording(self, noise, block, frame0, seed, text_kv):
        seen.append((self.role, block, text_kv))
        return denoise(self, noise, block, frame0, seed, text_kv)

    monkeypatch.setattr(RoleModel, "denoise", recording)
    session = tiny_pipe.session("a red fox", num_blocks=8, interp_blocks=3, **{**KW, **run})
    next(session)
    a = session.update(prompt="an owl at night").block  # blocks a, a+1, a+2 at weights 0, 0.5, 1
    assert a == 1 or run  # the reference loop: the next block; the native scheduler may have started more
    list(session)
    enc = tiny_pipe.components.text_encoder
    fox, owl = enc.encode("a red fox"), enc.encode("an owl at night")
    want = {b: fox if b <= a else torch.lerp(fox, owl, torch.tensor(0.5)) if b == a + 1 else owl for b in range(8)}
    assert {b for _, b, _ in seen} == set(range(8)) and a + 2 < 8
    for role, block, kv in seen:
        expected = getattr(tiny_pipe.components, role).encode_text(want[block])
        for got, ref in ((kv.keys, expected.keys), (kv.values, expected.values)):
            assert len(got) == len(ref) and all(torch.equal(g, r) for g, r in zip(got, ref)), (role, block)


def test_cli_prompt_schedule_file(tmp_path):
    import json

    from sdvg import cli

    (tmp_path / "s.yaml").write_text("- {block: 0, prompt: a red fox}\n- {block: 1, prompt: an owl, interp_blocks: 1}\n")
    assert cli.main(["generate", "--prompt-schedule", str(tmp_path / "s.yaml"), "--num-blocks", "2",
                     "--scheduler", "reference", "--quiet", "--out", str(tmp_path / "v.mp4"),
                     "--stats", str(tmp_path / "s.json")]) == 0
    stats = json.loads((tmp_path / "s.json").read_text())
    assert stats["live"]["updates"] == [{"block": 1, "prompt": "an owl", "interp_blocks": 1}]
    assert [b["live"]["prompt_index"] for b in stats["blocks"]] == [0, 1] and stats["video"]["prompt"] == "a red fox"
    assert cli.main(["generate", "--prompt-schedule", str(tmp_path / "s.yaml"), "--prompt", "x", "--quiet",
                     "--out", str(tmp_path / "w.mp4")]) == 2


def test_router_updates_replay_bitwise_from_the_recorded_schedule(tiny_pipe):
    """tau and the router options change at their acknowledged blocks; the batch run of the schedule the
    stats record gives the same video."""
    s = tiny_pipe.session("a red fox", num_blocks=4, **KW)
    blocks = [next(s)]
    s.update(router="pattern", pattern="10")  # from block 1: pattern[b % 2], so block 1 is rejected
    blocks.append(next(s))
    s.update(router="random", accept_prob=1.0, tau=0.5)  # from block 2: every draft accepted
    blocks += list(s)
    assert [b.decision for b in blocks] == ["forced", "rejected", "accepted", "accepted"]
    schedule = [{"block": 0, "prompt": "a red fox"}] + s.stats.extra["updates"]
    assert schedule[1:] == [{"block": 1, "router": "pattern", "pattern": "10"},
                            {"block": 2, "tau": 0.5, "router": "random", "accept_prob": 1.0}]
    replay = tiny_pipe(prompt_schedule=schedule, num_blocks=4, output_type="uint8", **KW)
    latents, frames = _video(blocks)
    assert torch.equal(latents, replay.latents) and torch.equal(frames, replay.frames[0])
