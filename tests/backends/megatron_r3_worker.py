"""One trainer rank of the Megatron R3 tests (launched by backend_helpers.run_ranks).

    python megatron_r3_worker.py r3:<tp>,<pp>,<ep>[,cp2] <out.json>   (TP > 1: sequence parallel)
    python megatron_r3_worker.py dense <out.json>      (train.router_replay on a dense model)

The recorded routing of every token is a function of (token id, position, layer) that the model's
own router almost never picks, so replay is visible: a hook on each megatron TopKRouter reads the
routing map the dispatcher receives and the token ids / positions the chunk was called with, and
checks each real token's experts against the record independently of the backend's bookkeeping.
Runs: replay off (measured only), replay on (old-logprob pass + training), replay on with full
activation recompute (same loss and gradient norm), and a sample without routing (refused on
every rank, weights untouched).
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import msgspec
import numpy as np
import torch
import torch.distributed as dist

torch.set_num_threads(1)

from backend_helpers import make_samples  # noqa: E402
from megatron_worker import weights_checksum  # noqa: E402

from miles.algo import LossConfig  # noqa: E402
from miles.algo.routing import pack_routing  # noqa: E402
from miles.backends import RankInfo, TrainConfig  # noqa: E402
from miles.backends.config import MegatronConfig  # noqa: E402
from miles.backends.megatron import MegatronBackend  # noqa: E402
from miles.tiny import build_tiny_model  # noqa: E402

E, K = 8, 2
PAIRS = list(itertools.combinations(range(E), K))


def recorded_set(token: int, pos: int, layer: int) -> tuple[int, int]:
    return PAIRS[(token * 7 + pos * 3 + layer * 11) % len(PAIRS)]


def with_routing(samples, layers: int):
    for s in samples:
        rows = [[recorded_set(int(s.tokens[t]), t, l) for l in range(layers)] for t in range(len(s.tokens) - 1)]
        s.routed_experts = pack_routing(np.array(rows, np.int32), E)
    return samples


class Probe(MegatronBackend):
    """Checks the experts each token reaches against the record, and keeps the router gradients.

    The whole padded row (megatron_step.padded_row) and, under context parallelism, the rank's
    layout (megatron_cp.attach) are caught as the backend builds each micro-batch, so every token
    a router sees is checked at its row position, whichever CP / SP slice holds it."""

    def init(self, *args, **kwargs):
        from miles.backends import megatron_cp, megatron_step

        super().init(*args, **kwargs)
        from megatron.core.transformer.moe.router import TopKRouter

        self.checked = self.matched = 0
        self.slices: set[tuple[int, int]] = set()   # (first token, tokens) each router call saw
        self.router_grads: list[float] = []
        self.real = set()       # token tuples of real samples (the padding segment is none)
        self._row = self._layout = None
        padded_row, attach = megatron_step.padded_row, megatron_cp.attach

        def remember_row(mb, length):
            ids, pos, seq_lens = padded_row(mb, length)
            self._row, self._layout = (ids[0].tolist(), pos[0].tolist(), seq_lens), None
            return ids, pos, seq_lens

        def remember_layout(params, layout):
            self._layout = layout
            return attach(params, layout)

        megatron_step.padded_row, megatron_cp.attach = remember_row, remember_layout
        for chunk in self.chunks:
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    module.register_forward_hook(self._check)

    def _check(self, router, args, output):
        from megatron.core import parallel_state as ps

        if router.router_replay.last_recompute:   # the row is another micro-batch's by then
            return
        _, routing_map = output
        ids, pos, seq_lens = self._row
        layer = router.router_replay.layer
        held = self._layout.local_index_host.tolist() if self._layout is not None else list(range(len(ids)))
        # Under sequence parallelism this TP rank's router sees only its slice of the held tokens.
        n = routing_map.shape[0]
        first = 0
        if router.config.sequence_parallel:
            assert n * ps.get_tensor_model_parallel_world_size() == len(held), (n, len(held))
            first = ps.get_tensor_model_parallel_rank() * n
        else:
            assert n == len(held), (n, len(held))
        self.slices.add((first, n, held[first]))
        bounds = list(itertools.accumulate(seq_lens, initial=0))
        sample_of = {}
        for a, b in zip(bounds, bounds[1:]):
            real = tuple(ids[a:b]) in self.real
            sample_of.update({t: (real, b) for t in range(a, b)})
        for i in range(n):
            row = held[first + i]
            real, end = sample_of[row]
            if not real or row == end - 1:   # padding, or a last token (no record: native routing)
                continue
            got = tuple(routing_map[i].nonzero().flatten().tolist())
            self.checked += 1
            self.matched += got == recorded_set(ids[row], pos[row], layer)

    def train(self, samples, phase=None):
        self.real = {tuple(int(x) for x in s.tokens) for s in samples}
        return super().train(samples, phase)

    def _optimizer_step(self, phase):
        from megatron.core.transformer.moe.router import TopKRouter
        norms = [float(m.weight.main_grad.double().norm()) for c in self.chunks for m in c.modules()
                 if isinstance(m, TopKRouter)]
        self.router_grads.append(sum(norms))
        return super()._optimizer_step(phase)


def run(cfg, rank, loss, samples) -> dict:
    backend = Probe()
    backend.init(cfg, rank, loss)
    metrics = backend.train(samples)
    out = {"metrics": metrics, "checked": backend.checked, "matched": backend.matched,
           "router_grad": backend.router_grads[0],
           "calls": sum(r.calls for r in backend.replay.replays),
           "layers": sorted(r.layer for r in backend.replay.replays),
           "sequence_parallel": backend.chunks[0].config.sequence_parallel,
           "offset_slices": sum(first > 0 for first, _, _ in backend.slices),
           "cp_slices": sum(row != first for first, _, row in backend.slices)}
    return out, backend


def r3(tp: int, pp: int, ep: int, out: Path, cp: int = 1) -> None:
    rank = RankInfo.from_env()
    path = str(build_tiny_model(arch="qwen3_moe"))
    layers = json.loads((Path(path) / "config.json").read_text())["num_hidden_layers"]
    mcfg = MegatronConfig(tp=tp, pp=pp, ep=ep, cp=cp)   # sequence parallel with TP > 1 (megatron's default)
    grpo = LossConfig(advantage_estimator="grpo", loss_reduction="rollout")
    samples = with_routing(make_samples(groups=2, per_group=4, siblings=2, seed=3), layers)
    base = TrainConfig(backend="megatron", model_path=path, param_dtype="float32", lr=1e-3,
                       max_tokens_per_microbatch=64, old_logprobs="recompute", megatron=mcfg)
    result: dict = {"rank": rank.rank}

    def fresh(**kw):
        return msgspec.structs.replace(base, **kw)

    for name, cfg in [("off", fresh()), ("on", fresh(router_replay=True)),
                      ("on_recompute", fresh(router_replay=True,
                                             megatron=msgspec.structs.replace(mcfg, recompute="full")))]:
        res, backend = run(cfg, rank, grpo, samples)
        result[name] = res
        if name == "on":
            bad = [msgspec.structs.replace(s) for s in samples]
            bad[3].routed_experts = None
            before = weights_checksum(backend)
            try:
                backend.train(bad)
                result["refused"] = None
            except ValueError as exc:
                result["refused"] = str(exc)
            result["refused_weights_kept"] = weights_checksum(backend) == before
    out.write_text(json.dumps(result, default=str))


def dense(out: Path) -> None:
    """train.router_replay on a dense model: refused at init, naming the model."""
    path = str(build_tiny_model(arch="qwen3"))
    cfg = TrainConfig(backend="megatron", model_path=path, param_dtype="float32", router_replay=True)
    try:
        MegatronBackend().init(cfg, RankInfo.from_env(), LossConfig())
        error = None
    except ValueError as exc:
        error = str(exc)
    out.write_text(json.dumps({"error": error, "path": path}))


if __name__ == "__main__":
    scenario, out_path = sys.argv[1], Path(sys.argv[2])
    kind, _, sizes = scenario.partition(":")
    if kind == "r3":
        tp, pp, ep, *flags = sizes.split(",")
        r3(int(tp), int(pp), int(ep), Path(out_path), cp=2 if "cp2" in flags else 1)
    elif kind == "dense":
        dense(Path(out_path))
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    dist.barrier()
    from miles.backends.megatron_model import destroy_parallel
    destroy_parallel()
