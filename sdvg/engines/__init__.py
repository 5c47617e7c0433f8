"""The engine runtime: engine modules with static shapes (`modules`), their signatures and cache keys
(`signatures`), the validated engine cache (`cache`), the executor interface (`executor`) and the
executors: TensorRT on torch's stream (`tensorrt`) or on cuda-python (`trt_cuda`), torch-tensorrt
programs (`torch_trt`) and onnxruntime (`onnxruntime`). Engines are built by the top-level
`build_engines` package, which imports this one (never the reverse); docs/engines.md."""
