"""The models: the causal Wan DiT (with RoPE and the native KV cache), the streaming Wan VAE decoder,
the ImageReward scorer, the umT5 text encoder, tokenizers, and checkpoint loading. The lowest
layer above `sdvg.config`: nothing here imports `sdvg.generation`, `sdvg.engines` or higher."""
