"""The engine runtime: static stage modules (`stages`), their signatures and cache keys
(`signatures`), the validated engine cache (`cache`) and the TensorRT and onnxruntime executors
(`tensorrt`, `onnxruntime`). Engines are built by the top-level `build_engines` package, which
imports this one (never the reverse); docs/engines.md."""
