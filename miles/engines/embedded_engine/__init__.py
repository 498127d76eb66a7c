"""The embedded engine's parts (entry point and CLI: miles/engines/embedded.py).

model.py      Qwen-family forward over HF weights (fused storage, checkpoint-name views)
kv_cache.py   token-slot KV pool shared by all requests (SGLang's page size 1)
prefix_cache.py radix tree of cached KV slots over token ids (SGLang's radix cache)
runner.py     model + pool + decode step, eager or CUDA graph per (batch, kv) bucket
sampling.py   batched per-request sampling, seeded, raw-distribution logprobs
scheduler.py  continuous batching, retraction, pause modes, weight-version spans
protocol.py   SGLang's request bodies and their validation
server.py     the aiohttp routes (SGLang's native API + /weights_checksum)
weights.py    weight updates (disk, tensor, torch.distributed) and checksums
delta.py      disk-delta updates (engine side of miles/weights/disk_delta.py)
tp.py         --tp-size N: rank 0 drives worker ranks by broadcast commands; supervision
p2p_routes.py the P2P weight transfer's engine side (/p2p_layout, /init_p2p_group, ...)
"""
