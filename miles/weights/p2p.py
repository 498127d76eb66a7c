"""P2P resharded weight transfer: every trainer rank sends, each engine rank receives only its shards.

    plan = make_plan(specs, trainer_world=T, engine=EngineLayout(tp=E))   # pure, data in -> data out
    P2PTransport(rank, plan, ...)  on every trainer rank (every rank a sender)
    p2p_receiver.py                on every engine rank (holds its slices)

Design decisions:
- The plan is pure data. Each HF tensor's needed region on engine rank j is a box (a (start, length)
  per dim): a TP slice on one dim (column-parallel weights on dim 0, row-parallel on dim 1, vocab
  on dim 0, the rest replicated, SGLang's cuts for Llama/Qwen), or for MoE the whole expert on the
  rank that owns it (EP over the engine ranks, experts in equal contiguous ranges). Trainer rank i
  holds dim-0 rows in torch.chunk's split (FSDP2's Shard(0)). A piece is the intersection of one
  trainer box and one engine box: each byte of each engine shard comes from exactly one trainer
  rank, and a sender sends exactly the bytes its pieces cover (counted in `sent_bytes`).
- One process group holds every trainer rank and every engine rank (trainers 0..T-1, engines
  T..T+E-1); the bytes move by point-to-point isend/irecv between pairs, all pairs of a bucket in
  one `batch_isend_irecv` (NCCL launches them together; gloo runs each pair on its own
  connection). No broadcast of tensors, no gather on rank 0. Per-pair groups would cost T x E
  communicators for the same effect.
- Per bucket, trainer rank 0 broadcasts the bucket's tensor indices (a few int64s); both sides then
  know from the plan which pieces go between which pair and in what order, so only one flat
  buffer per (sender, target) moves, and no names cross the wire.
- The contract's `send_bucket` receives full tensors (the FSDP backend gathers every parameter on
  every rank today); this transport reads only its own rows of them. `publish_local(model)` sends
  straight from the rank's own FSDP2 Shard(0) locals with no collective but the tiny control
  broadcasts (dense models; fused MoE experts still take the gather path).
- Control values broadcast by rank 0 at the start of a version: v >= 0 (a version), STOP (receivers
  exit). A bucket header of END closes a version; a barrier then says every receiver has its
  bytes in place.
- From a recipe (`weights.transport = "p2p"`, `P2PTransport.for_engines`), the targets are
  embedded engines (embedded_engine/p2p_routes.py): trainer rank 0 asks each engine for its
  layout (`/p2p_layout`: its full tensor names and shapes, its TP size, its dtype), makes the plan
  and hands it with the group's port to the other trainer ranks (one gloo broadcast of msgpack
  bytes over the trainers' default group), and asks every engine to join (`/init_p2p_group`,
  engine e's TP rank j at T + e*tp + j) while every trainer rank joins. Several engines each get
  their own copy of the pieces (same plan, other target ranks). Per version rank 0 posts
  `/update_weights_from_p2p` to every engine first (the call receives the version on every TP
  rank and answers after the closing barrier), so `finish` waits for those answers: that wait is
  the load time the publisher reports. No STOP in this mode: `close` asks the engines to leave.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import fnmatch
import json
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import logging

import msgspec
import torch
import torch.distributed as dist

from miles.weights.base import BucketStream, TransferStats

log = logging.getLogger(__name__)

END, STOP = -1, -2
EXPERT = re.compile(r"\.experts\.(\d+)\.")
# (glob on the HF name, TP dim); first match wins, no match: replicated
TP_RULES = [("*.q_proj.*", 0), ("*.k_proj.*", 0), ("*.v_proj.*", 0), ("*.gate_proj.weight", 0),
            ("*.up_proj.weight", 0), ("*.o_proj.weight", 1), ("*.down_proj.weight", 1),
            ("*embed_tokens.weight", 0), ("lm_head.weight", 0)]

Box = list[tuple[int, int]]  # (start, length) per dim


class TensorSpec(msgspec.Struct, array_like=True):
    name: str
    shape: list[int]


class EngineLayout(msgspec.Struct, kw_only=True):
    tp: int = 1                        # engine ranks; EP runs over the same ranks
    rules: list[tuple[str, int]] = msgspec.field(default_factory=lambda: list(TP_RULES))


class Piece(msgspec.Struct, array_like=True):
    tensor: int       # index into Plan.specs
    sender: int       # trainer rank
    target: int       # engine rank
    box: Box          # in full-tensor coordinates


class Plan(msgspec.Struct, kw_only=True):
    specs: list[TensorSpec]
    trainer_world: int
    engine: EngineLayout
    engine_boxes: list[list[Box | None]]   # [tensor][engine rank] -> its shard (None: holds none)
    pieces: list[list[Piece]]              # [tensor] -> pieces, by (sender, target)

    def index(self) -> dict[str, int]:
        return {s.name: i for i, s in enumerate(self.specs)}

    def bytes_between(self, itemsize: int) -> dict[tuple[int, int], int]:
        out: dict[tuple[int, int], int] = {}
        for pieces in self.pieces:
            for p in pieces:
                key = (p.sender, p.target)
                out[key] = out.get(key, 0) + _numel(p.box) * itemsize
        return out


def _numel(box: Box) -> int:
    n = 1
    for _, length in box:
        n *= length
    return n


def trainer_box(shape: list[int], world: int, rank: int) -> Box | None:
    """Rows of dim 0 that trainer `rank` holds (torch.chunk's split, FSDP2's Shard(0))."""
    if not shape:
        return [] if rank == 0 else None
    chunk = -(-shape[0] // world)
    start = rank * chunk
    length = max(0, min(chunk, shape[0] - start))
    return [(start, length)] + [(0, n) for n in shape[1:]] if length else None


def engine_box(spec: TensorSpec, layout: EngineLayout, rank: int, experts: int) -> Box | None:
    full = [(0, n) for n in spec.shape]
    m = EXPERT.search(spec.name)
    if m and experts:
        if experts % layout.tp:
            raise ValueError(f"p2p plan: {experts} experts do not split over engine tp={layout.tp}")
        return full if int(m.group(1)) // (experts // layout.tp) == rank else None
    for pattern, dim in layout.rules:
        if fnmatch.fnmatchcase(spec.name, pattern):
            if dim >= len(spec.shape) or spec.shape[dim] % layout.tp:
                raise ValueError(f"p2p plan: {spec.name} {spec.shape} does not split into "
                                 f"tp={layout.tp} on dim {dim}")
            part = spec.shape[dim] // layout.tp
            full[dim] = (rank * part, part)
            return full
    return full


def _intersect(a: Box, b: Box) -> Box | None:
    out = []
    for (sa, la), (sb, lb) in zip(a, b):
        start, end = max(sa, sb), min(sa + la, sb + lb)
        if end <= start:
            return None
        out.append((start, end - start))
    return out


def make_plan(specs: list[TensorSpec], *, trainer_world: int, engine: EngineLayout) -> Plan:
    if trainer_world < 1 or engine.tp < 1:
        raise ValueError(f"p2p plan: trainer_world={trainer_world} and engine tp={engine.tp} must be >= 1")
    experts = 1 + max((int(m.group(1)) for s in specs if (m := EXPERT.search(s.name))), default=-1)
    boxes, pieces = [], []
    for t, spec in enumerate(specs):
        per_engine = [engine_box(spec, engine, j, experts) for j in range(engine.tp)]
        boxes.append(per_engine)
        mine = []
        for i in range(trainer_world):
            held = trainer_box(spec.shape, trainer_world, i)
            if held is None:
                continue
            for j, need in enumerate(per_engine):
                if need is not None and (box := _intersect(held, need) if spec.shape else []) is not None:
                    mine.append(Piece(tensor=t, sender=i, target=j, box=box))
        pieces.append(mine)
    return Plan(specs=list(specs), trainer_world=trainer_world, engine=engine, engine_boxes=boxes,
                pieces=pieces)


def region(t: torch.Tensor, box: Box, origin: Box | None = None) -> torch.Tensor:
    """The view of `t` covering `box`; `origin` is where `t` itself starts (a shard)."""
    for dim, (start, length) in enumerate(box):
        t = t.narrow(dim, start - (origin[dim][0] if origin else 0), length)
    return t


def local_hf_shards(model: torch.nn.Module, world: int, rank: int, dtype: torch.dtype):
    """(HF name, this rank's dim-0 shard or None, its box, full bytes) per parameter, from FSDP2's
    Shard(0) locals as they are: no collective. Dense models only: fused MoE experts are renamed
    into per-expert tensors, whose holders the plan does not describe (yet)."""
    from miles.backends.hf_weights import to_hf_names
    for name, param in model.named_parameters():
        data = param.detach()
        placements = getattr(data, "placements", None)
        if placements is not None and not (len(placements) == 1 and placements[0].is_shard(0)):
            raise ValueError(f"p2p: parameter {name} is laid out as {placements}, not FSDP2's Shard(0)")
        shape = list(data.shape)
        if [n for n, _ in to_hf_names(name, torch.empty(shape, device="meta"))] != [name]:
            raise ValueError(f"p2p: parameter {name} is renamed on export (fused experts); publish "
                             "it with send_bucket (full tensors)")
        local = data.to_local() if placements is not None else data
        box = trainer_box(shape, world, rank)
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        yield name, (local.to(dtype) if box is not None else None), box, nbytes


@dataclass
class P2PGroup:
    """The trainers + engine ranks group (process_group.init_custom_process_group)."""
    pg: object
    trainers: int
    rank: int  # in this group (an engine rank's process may have no default group to ask)
    device: torch.device | None = None  # NCCL: control values live on this rank's GPU

    def control(self, value: int | list[int]) -> list[int]:
        """Rank 0 says `value`; everyone returns it (every member calls this)."""
        dev = self.device or torch.device("cpu")
        n = torch.tensor([len(value) if isinstance(value, list) else 1], dtype=torch.int64, device=dev)
        dist.broadcast(n, src=0, group=self.pg)
        data = torch.tensor(value if isinstance(value, list) else [value], dtype=torch.int64,
                            device=dev) if self.rank == 0 else \
            torch.empty(int(n), dtype=torch.int64, device=dev)
        dist.broadcast(data, src=0, group=self.pg)
        return data.tolist()

    def barrier(self) -> None:
        dist.all_reduce(torch.zeros(1, device=self.device or torch.device("cpu")), group=self.pg)


class P2PTransport(BucketStream):
    """One per trainer rank; `connect` joins the group (the receivers join the same address).
    Every rank sends (the rows it holds): the default traits."""

    def __init__(self, rank: int, plan: Plan | None, *, backend: str = "gloo",
                 address: str = "127.0.0.1", port: int = 0, timeout_s: float = 120.0,
                 dtype: torch.dtype = torch.float32):
        self.rank, self.plan, self.backend = rank, plan, backend
        self.address, self.port, self.timeout_s, self.dtype = address, port, timeout_s, dtype
        self.group: P2PGroup | None = None
        self._index = plan.index() if plan is not None else {}
        self.sent_bytes: dict[int, int] = {}
        self._stats = TransferStats()
        self.cfg = None            # a WeightsConfig: engines mode (for_engines)
        self.world_size = 1
        self.engine_urls: list[str] = []
        self.engines = 1           # copies of the plan's engine ranks (one per engine)
        self._loads: list[cf.Future] = []
        self._pool: cf.ThreadPoolExecutor | None = None
        self._trainers_pg = None
        self._joins = 0

    @classmethod
    def for_engines(cls, config, *, rank: int, world_size: int) -> "P2PTransport":
        """Every trainer rank of a recipe run (`weights.transport = "p2p"`); the plan is made at
        `connect` from the engines' layout."""
        from miles.weights.nccl import resolve_group_backend
        t = cls(rank, None, backend=resolve_group_backend(config.group_backend),
                address=config.master_address, port=config.master_port,
                timeout_s=config.connect_timeout_s)
        t.cfg, t.world_size = config, world_size
        return t

    def connect(self, engine_urls: list[str]) -> None:
        if self.cfg is not None:
            return self._connect_engines(engine_urls)
        from miles.weights.process_group import init_custom_process_group
        world = self.plan.trainer_world + self.plan.engine.tp
        pg = init_custom_process_group(self.backend, self.address, self.port, world, self.rank,
                                       "miles-p2p", self.timeout_s)
        self.group = P2PGroup(pg, self.plan.trainer_world, self.rank, _group_device(self.backend))

    # ---- engines mode: the plan from the engines' layout, the engines joined over HTTP --------

    def _connect_engines(self, engine_urls: list[str]) -> None:
        from miles.weights.process_group import (create_group_with_engines, free_port,
                                                 init_custom_process_group)
        if not engine_urls:
            raise ValueError("connect: engine_urls is empty; the p2p transport needs an engine")
        cfg, T = self.cfg, self.world_size
        self.engine_urls = list(engine_urls)
        blob = None
        if self.rank == 0:
            layouts = [_http("GET", f"{u}/p2p_layout", None, cfg.control_timeout_s)
                       for u in self.engine_urls]
            for u, lay in zip(self.engine_urls, layouts):
                if "specs" not in lay:
                    raise RuntimeError(f"p2p: engine {u} has no /p2p_layout ({lay.get('message')}); "
                                       "weights.transport = \"p2p\" needs embedded engines")
            first = layouts[0]
            for u, lay in zip(self.engine_urls[1:], layouts[1:]):
                if lay["specs"] != first["specs"] or lay["tp_size"] != first["tp_size"]:
                    raise RuntimeError(f"p2p: engine {u} serves another layout (tp_size "
                                       f"{lay['tp_size']}) than {self.engine_urls[0]} (tp_size "
                                       f"{first['tp_size']}); every engine must be the same")
            plan = make_plan([TensorSpec(n, shape) for n, shape in first["specs"]],
                             trainer_world=T, engine=EngineLayout(tp=int(first["tp_size"])))
            port = cfg.master_port or free_port(cfg.master_address)
            blob = msgspec.msgpack.encode([port, first["dtype"], plan])
        port, dtype, plan = msgspec.msgpack.decode(self._share(blob))
        self.plan = msgspec.convert(plan, Plan)
        self._index, self.dtype, self.engines = self.plan.index(), getattr(torch, dtype), len(engine_urls)
        tp = self.plan.engine.tp
        world = T + self.engines * tp
        name = f"{cfg.group_name}-p2p" + (f".{self._joins}" if self._joins else "")
        self._joins += 1
        if self.rank == 0:
            self._pool = self._pool or cf.ThreadPoolExecutor(max(2, 2 * len(engine_urls)),
                                                             thread_name_prefix="weights-p2p")
            wire_plan = base64.b64encode(msgspec.msgpack.encode(self.plan)).decode()
            joins = [self._pool.submit(_http, "POST", f"{u}/init_p2p_group", {
                "master_address": cfg.master_address, "master_port": port,
                "rank_offset": T + e * tp, "world_size": world, "group_name": name,
                "plan": wire_plan, "dtype": dtype, "backend": self.backend,
                "timeout_s": cfg.connect_timeout_s}, cfg.connect_timeout_s + 10.0)
                for e, u in enumerate(self.engine_urls)]
            pg = create_group_with_engines(
                backend=self.backend, master_address=cfg.master_address, master_port=port,
                world_size=world, group_name=name, timeout_s=cfg.connect_timeout_s,
                engine_joins=joins, engine_urls=self.engine_urls,
                collective_timeout_s=cfg.group_timeout_s)
        else:
            pg = init_custom_process_group(self.backend, cfg.master_address, port, world, self.rank,
                                           name, cfg.connect_timeout_s, cfg.group_timeout_s)
        self.group = P2PGroup(pg, T, self.rank, _group_device(self.backend))

    def _share(self, blob: bytes | None) -> bytes:
        """Rank 0's bytes on every trainer rank (a gloo group over the trainers' default group)."""
        if self.world_size == 1:
            return blob
        if self._trainers_pg is None:
            self._trainers_pg = dist.new_group(backend="gloo")
        n = torch.tensor([len(blob) if blob is not None else 0], dtype=torch.int64)
        dist.broadcast(n, src=0, group=self._trainers_pg)
        buf = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob is not None else \
            torch.empty(int(n), dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self._trainers_pg)
        return buf.numpy().tobytes()

    def _wait_loads(self, version: int) -> None:
        """Rank 0: every engine answered its `/update_weights_from_p2p` (the load barrier)."""
        t = time.perf_counter()
        loads, self._loads = self._loads, []
        for url, fut in zip(self.engine_urls, loads):
            answer = fut.result(self.cfg.bucket_timeout_s)
            if not answer.get("success"):
                raise RuntimeError(f"p2p version {version}: engine {url} failed to receive: "
                                   f"{answer.get('message')}")
        self._stats.load_s = time.perf_counter() - t

    # ---- a version ---------------------------------------------------------------------------

    def begin(self, version: int) -> None:
        if self.group is None:
            raise RuntimeError("begin: the p2p transport is not connected; call connect()")
        if self.cfg is not None and self.rank == 0:  # each engine receives while we send
            self._loads = [self._pool.submit(_http, "POST", f"{u}/update_weights_from_p2p", {},
                                             self.cfg.bucket_timeout_s) for u in self.engine_urls]
        self.group.control(version)
        self.sent_bytes = {j: 0 for j in range(self.plan.engine.tp * self.engines)}
        self._stats = TransferStats()

    def send_bucket(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Full tensors: this rank sends the rows it holds (trainer_box) of each."""
        shards = []
        for name, full in named_tensors:
            t = self._tensor_index(name)
            box = trainer_box(self.plan.specs[t].shape, self.plan.trainer_world, self.rank)
            shards.append((name, region(full, box) if box is not None else None, box))
        self.send_shards(shards)
        self._stats.tensors += len(named_tensors)
        self._stats.bytes += sum(t.numel() * t.element_size() for _, t in named_tensors)

    def send_shards(self, shards: list[tuple[str, torch.Tensor | None, Box | None]]) -> None:
        """(HF name, this rank's shard, where the shard starts) -> one flat buffer per engine rank."""
        ids = [self._tensor_index(name) for name, _, _ in shards]
        self.group.control(ids)  # from rank 0; every rank walks the same bucket sequence
        per_target: dict[int, list[torch.Tensor]] = {}
        for (name, shard, origin), t in zip(shards, ids):
            for piece in self.plan.pieces[t]:
                if piece.sender == self.rank:
                    part = region(shard, piece.box, origin).to(self.dtype).reshape(-1)
                    per_target.setdefault(piece.target, []).append(part)
        ops, tp = [], self.plan.engine.tp
        for j, parts in per_target.items():
            flat = torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()
            for e in range(self.engines):  # engine e's TP rank j (one engine: group rank T + j)
                ops.append(dist.P2POp(dist.isend, flat, self.plan.trainer_world + e * tp + j,
                                      group=self.group.pg))
                self.sent_bytes[e * tp + j] += flat.numel() * flat.element_size()
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        self._stats.buckets += 1
        self._stats.payload_bytes = sum(self.sent_bytes.values())

    def publish_local(self, model: torch.nn.Module, version: int, *, bucket_bytes: int = 512 << 20,
                      dtype: torch.dtype | None = None) -> None:
        """The whole publish from this rank's own FSDP2 shards: no gather at all (dense models;
        every rank calls it, as update_weights)."""
        self.begin(version)
        bucket, size = [], 0
        for name, shard, box, nbytes in local_hf_shards(model, self.plan.trainer_world, self.rank,
                                                        dtype or self.dtype):
            bucket.append((name, shard, box))
            size += nbytes
            self._stats.tensors += 1
            self._stats.bytes += nbytes
            if size >= bucket_bytes:
                self.send_shards(bucket)
                bucket, size = [], 0
        if bucket:
            self.send_shards(bucket)
        self.finish(version)

    def finish(self, version: int) -> None:
        self.group.control([END])
        self.group.barrier()  # every receiver has its bytes in place
        if self.cfg is not None and self.rank == 0:
            self._wait_loads(version)
        if self.cfg is not None:  # every sender's count, for the logs (and the recipe's test)
            log.info("p2p version %d: trainer rank %d sent bytes to engine ranks %s", version,
                     self.rank, sorted(self.sent_bytes.items()))

    def abandon(self, version: int) -> None:
        """A failed publish: drop the group (a later connect builds a fresh one)."""
        if self.group is not None:
            from miles.weights.process_group import destroy_group
            destroy_group(self.group.pg)
            self.group = None

    def close(self) -> None:
        if self.cfg is not None:  # engines mode: they leave on request, no STOP broadcast
            if self.rank == 0:
                for u in self.engine_urls:
                    try:
                        _http("POST", f"{u}/destroy_p2p_group", {}, self.cfg.control_timeout_s)
                    except Exception:  # noqa: BLE001 - best effort: the engine may be gone
                        pass
            if self.group is not None:
                from miles.weights.process_group import destroy_group
                destroy_group(self.group.pg)
                self.group = None
            return
        if self.group is not None:
            self.group.control(STOP)
            dist.destroy_process_group(self.group.pg)
            self.group = None

    def _tensor_index(self, name: str) -> int:
        try:
            return self._index[name]
        except KeyError:
            raise ValueError(f"p2p: tensor {name!r} is not in the transfer plan (the plan was made "
                             f"for {len(self._index)} tensors from another model?)") from None


def _http(method: str, url: str, body: dict | None, timeout_s: float) -> dict:
    """One JSON call to an engine; a 4xx/5xx answer comes back as its JSON (success: false),
    anything unreadable as a RuntimeError naming the URL."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        text = e.read().decode(errors="replace")
        try:
            answer = json.loads(text)
        except ValueError:
            answer = {}
        msg = answer.get("message") or (answer.get("error") or {}).get("message") or text[:500]
        return {"success": False, "message": f"{method} {url}: HTTP {e.code}: {msg}"}
    except (urllib.error.URLError, OSError) as e:
        raise RuntimeError(f"{method} {url}: {e}") from None


def _group_device(backend: str) -> torch.device | None:
    """Where this process's control tensors of the group live: its current GPU for NCCL."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
