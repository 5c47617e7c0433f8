"""Every MP4 sdvg writes says its colour: BT.709 primaries, transfer and matrix in limited range, and its pixels
are converted with that matrix (a player that reads the tags shows the frames sdvg made)."""
from __future__ import annotations

import subprocess

import numpy as np
import torch


def test_mp4s_are_tagged_bt709_limited_and_converted_so(tmp_path):
    import imageio_ffmpeg

    from sdvg.io.video_writer import IncrementalMP4Writer, read_mp4_frames

    colours = np.array([[128, 128, 128], [200, 30, 30], [30, 200, 30], [30, 30, 200]], dtype=np.uint8)
    frames = torch.from_numpy(np.broadcast_to(colours[:, None, None, :], (4, 32, 48, 3)).copy())  # flat frames
    path = tmp_path / "c.mp4"
    writer = IncrementalMP4Writer(path, fps=16, crf=0)
    writer.write(frames)
    writer.close()
    report = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-hide_banner", "-i", str(path)], capture_output=True,
                            text=True).stderr
    video = next(line for line in report.splitlines() if "Video:" in line)
    assert "yuv420p(tv, bt709" in video and "unknown" not in video, video  # matrix, primaries, transfer, range
    back = read_mp4_frames(path).astype(int)  # decoded by the tags
    assert np.abs(back - frames.numpy().astype(int)).max() <= 3  # flat colours: no chroma edge, the matrix alone
