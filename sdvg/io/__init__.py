"""Output files: the incremental MP4 writer."""
