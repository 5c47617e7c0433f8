"""The engine runtime: static stage modules (`stages`), their signatures and cache keys
(`signatures`), the validated engine cache (`cache`) and the TensorRT executor (`tensorrt`).
Engines are built by the top-level `build_engines` package, which imports this one (never the
reverse)."""
