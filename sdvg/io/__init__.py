"""Output files: the incremental MP4 writer (`video_writer`). The defaults live here, torch-free, so the
command line can show them without importing torch."""

DEFAULT_FPS = 16  # Wan2.1's frame rate
DEFAULT_CRF = 10  # libx264 constant rate factor (imageio's quality 8): near-lossless
