"""Engine builds for sdvg: export each engine module (static shapes), build one TensorRT plan per engine per
GPU, and keep them in a validated cache. See `python -m build_engines --help`."""
