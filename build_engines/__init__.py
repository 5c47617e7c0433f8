"""Engine builds for sdvg: export each stage (static shapes), build one TensorRT engine per stage per
GPU, and keep them in a validated cache. See `python -m build_engines --help`."""
