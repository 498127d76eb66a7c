"""The embedded engine's parts (entry point and CLI: miles/engines/embedded.py).

model.py      Qwen-family forward over HF weights (flat token batch, prefill and decode)
shapes.py     ModelShape from an HF config, the tensor-parallel split, KV bytes per token
params.py     Weights: fused storage, checkpoint-name views, the safetensors loader
kv_cache.py   token-slot KV pool shared by all requests (SGLang's page size 1)
prefix_cache.py radix tree of cached KV slots over token ids (SGLang's radix cache)
runner.py     model + pool + decode step, eager or CUDA graph per (batch, kv) bucket
graphs.py     the decode step's CUDA graphs, captured per (batch, kv) bucket
sampling.py   batched per-request sampling, seeded, raw-distribution logprobs
scheduler.py  continuous batching, retraction, pause modes, weight-version spans
request.py    one request as the scheduler holds it
protocol.py   SGLang's request bodies and their validation (responses.py: the JSON replies)
server.py     the aiohttp routes (SGLang's native API)
server_weights.py the weight-update routes (disk, delta, tensor, distributed, /weights_checksum)
weights.py    weight updates (disk, tensor, torch.distributed) and checksums
delta.py      disk-delta updates (engine side of miles/weights/disk_delta.py)
tp.py         --tp-size N: rank 0 drives worker ranks by broadcast commands; supervision
p2p_routes.py the P2P weight transfer's engine side (/p2p_layout, /init_p2p_group, ...)
"""
