"""`miles plan recipe.toml [--gpus N] [--model-size S] [--inputs file.json] [--set k=v ...]`: a
capacity model. It predicts, for the recipe's loop mode, the step time, the trainer's and the
engines' idle fractions and the staleness of the trained groups, from measured per-component
throughputs (docs/capacity.md has the equations, the calibration table and the projections).

Design decisions:
- A small discrete-event simulation of the loop, not a closed form: the interesting behaviour
  (the sync step waits for its longest sample; fully-async hides it until admission stops it) is
  in the interplay of sampled lengths, continuous batching and the buffer's admission rules,
  which a formula gets wrong at the edges. The rules are the real ones: admission rules A and B
  are the buffer's own function (`miles/actors/admission.py:admits`), batches taken in slot
  order, the staleness of a group counted from the version its first token was generated with,
  publishes pausing every engine.
- An engine is continuous batching: every running sequence gets one token per decode step, and
  a step costs `decode_fixed_s + decode_per_seq_s x running + decode_per_ctx_token_s x context`
  (the fixed part is the weights read or, for small models, the host's launch cost; context is
  the tokens of every running sequence, prompt and response so far: the KV read). A new request
  first costs its prefill. Progress is kept as one counter per engine and a heap of the step
  counts at which its sequences finish; between events the step cost grows linearly with
  progress (each running sequence one token per step), so the time to a given progress is a
  quadratic's root, and a simulated step costs O(log n) however long the responses are.
- Every input is a `Figure(value, source)` (`miles/plan_inputs.py`, with the figures per model
  size): a file and a measured run, a bench line, or "assumed: <why>". The output repeats them,
  so a prediction can be traced to its evidence.
- Devices that share a machine (the 2-core CPU: engine and trainer on the same cores) slow each
  other down; `train_overlap_slowdown` / `engine_overlap_slowdown` (measured, 1.0 on separate
  GPUs) stretch the trainer's step when engines are busy and the engines' steps while it trains.
- Bad input is one `PlanError` naming the field and the value (unknown model size, fewer GPUs
  than the model needs, an unknown input figure).
"""

from __future__ import annotations

import bisect
import heapq
import json
import math
from dataclasses import dataclass, field

import numpy as np

from miles.actors.admission import admits
from miles.config import RecipeError, load_recipe
from miles.plan_inputs import Inputs, Lengths, PlanError, figure_fields, model_sizes, override_inputs


@dataclass(frozen=True)
class Deployment:
    mode: str
    max_staleness: int
    groups_per_step: int
    n_samples: int
    max_inflight_samples: int
    capacity_groups: int
    num_engines: int
    max_running: int                # per engine
    gpus_per_engine: int
    train_gpus: int
    lengths: Lengths


# ----- the simulation ------------------------------------------------------------------------------

class _Engine:
    def __init__(self, fixed_s: float, per_seq_s: float, per_ctx_s: float = 0.0,
                 prompt_tokens: float = 0.0):
        self.fixed_s, self.per_seq_s, self.per_ctx_s = fixed_s, per_seq_s, per_ctx_s
        self.prompt_tokens = prompt_tokens
        self.t = 0.0
        self.progress = 0.0                         # decode steps done since the start
        self.targets: list[tuple[float, int]] = []  # (progress at which it ends, sample id)
        self.starts: dict[int, float] = {}          # sample id -> progress when it started
        self.start_sum = 0.0
        self.stall = 0.0                            # prefill seconds owed before decoding goes on
        self.paused = False
        self.slowdown = 1.0
        self.epoch = 0                              # invalidates scheduled events
        self.idle_s = self.paused_s = self.batch_s = 0.0   # batch_s: running sequences x seconds

    def start(self, sid: int, length: int) -> None:
        self.starts[sid] = self.progress
        self.start_sum += self.progress
        heapq.heappush(self.targets, (self.progress + length, sid))

    def finish(self) -> int:
        _, sid = heapq.heappop(self.targets)
        self.start_sum -= self.starts.pop(sid)
        return sid

    def step_s(self) -> float:
        """Seconds of the next decode step: fixed, per running sequence, per context token."""
        n = len(self.targets)
        ctx = n * (self.prompt_tokens + self.progress) - self.start_sum
        return (self.fixed_s + self.per_seq_s * n + self.per_ctx_s * ctx) * self.slowdown

    def _steps_in(self, seconds: float) -> float:
        """Decode steps done in `seconds` from now: each step costs `step_s() + g x steps so
        far` (g: every running sequence's context grows by one token per step)."""
        s0, g = self.step_s(), self.per_ctx_s * len(self.targets) * self.slowdown
        if g <= 0:
            return seconds / s0
        return 2 * seconds / (s0 + math.sqrt(s0 * s0 + 2 * g * seconds))  # the quadratic's root

    def _seconds_for(self, steps: float) -> float:
        return steps * self.step_s() + 0.5 * self.per_ctx_s * len(self.targets) * self.slowdown * steps * steps

    def advance(self, now: float) -> None:
        dt, self.t = now - self.t, now
        if dt <= 0:
            return
        if self.paused:
            self.paused_s += dt
            return
        if not self.targets:
            self.idle_s += dt
            return
        self.batch_s += len(self.targets) * dt
        used = min(self.stall, dt)
        self.stall -= used
        self.progress += self._steps_in(dt - used)

    def next_time(self) -> float:
        if self.paused or not self.targets:
            return math.inf
        return self.t + self.stall + self._seconds_for(max(0.0, self.targets[0][0] - self.progress))


@dataclass
class _Group:
    slot: int
    lengths: np.ndarray
    left: int
    version: int = -1               # the version its first token was generated with
    tokens: int = 0


@dataclass
class Result:
    step_s: float
    trainer_idle_frac: float
    engine_idle_frac: float
    engine_paused_frac: float
    staleness_mean: float
    staleness_max: int
    gen_tokens_per_s: float
    steps: int
    stale_groups: int               # handed back by the backstop (lag > max_staleness + 1)
    decode_batch_mean: float        # running sequences per engine, averaged over its busy time
    step_times: list[float] = field(repr=False, default_factory=list)


class _Window:
    """The simulated slot table, as much of it as admission reads (`admits`, the buffer's rule)."""

    def __init__(self, groups_per_step: int, max_staleness: int):
        self.groups_per_step, self.max_staleness = groups_per_step, max_staleness
        self.next_slot = self.handed_back = 0
        self.back_slots: list[int] = []             # sorted
        self.holding: list[int] = []                # heap of generating slots (lazy)
        self.generating: set[int] = set()

    def open(self) -> int:
        slot = self.next_slot
        self.generating.add(slot)
        heapq.heappush(self.holding, slot)
        self.next_slot += 1
        return slot

    def done(self, slot: int) -> None:
        """Its group finished generating: it no longer holds the window (rule B)."""
        self.generating.discard(slot)

    def hand_back(self, slot: int) -> None:
        self.handed_back += 1
        bisect.insort(self.back_slots, slot)

    def admits(self, versions_published: int) -> bool:
        while self.holding and self.holding[0] not in self.generating:
            heapq.heappop(self.holding)
        oldest = self.holding[0] if self.holding else None
        back_after = 0 if oldest is None else \
            len(self.back_slots) - bisect.bisect_right(self.back_slots, oldest)
        return admits(admitted=self.next_slot, handed_back=self.handed_back,
                      versions_published=versions_published,
                      groups_per_step=self.groups_per_step, max_staleness=self.max_staleness,
                      oldest_holding=oldest, back_after_oldest=back_after)


class _LoopSim:
    """One simulated run of the loop: an event queue and one `on_<event>` method per event
    (engine: a sequence may have finished; group: a group is complete; trained: the trainer's
    step ended, the publish starts; published: the engines resume on the next version)."""

    def __init__(self, dep: Deployment, inp: Inputs, seed: int):
        self.dep, self.inp = dep, inp
        self.rng = np.random.default_rng(seed)
        self.G = dep.groups_per_step
        self.engines = [_Engine(inp.decode_fixed_s.value, inp.decode_per_seq_s.value,
                                inp.decode_per_ctx_token_s.value, inp.prompt_tokens.value)
                        for _ in range(dep.num_engines)]
        self.events: list[tuple[float, int, str, object]] = []
        self.seq = 0
        self.version = 0
        self.window = _Window(dep.groups_per_step, dep.max_staleness)
        self.groups: dict[int, _Group] = {}
        self.sample_group: dict[int, int] = {}
        self.waiting: list[tuple[int, int]] = []    # (sample id, length) FIFO for the semaphore
        self.wait_pos = 0
        self.queue: list[int] = []                  # queued slots (heap)
        self.waiting_room: list[int] = []           # groups done, buffer full
        self.inflight = 0
        self.next_sample = 0
        self.trainer_state, self.trainer_since, self.trainer_idle = "wait", 0.0, 0.0
        self.step_ends: list[float] = []
        self.idle_at_step: list[float] = []
        self.staleness: list[int] = []
        self.gen_tokens = self.stale = 0
        self.stall_s = inp.publish_fixed_s.value + inp.publish_s_per_gb.value * inp.weight_gb.value

    # ---- the event queue ------------------------------------------------------------------

    def push(self, t: float, kind: str, payload: object = None) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, payload))

    def schedule(self, i: int) -> None:
        e = self.engines[i]
        e.epoch += 1
        t = e.next_time()
        if t < math.inf:
            self.push(t, "engine", (i, e.epoch))

    def run(self, steps: int) -> float:
        """Events until `steps` training steps have ended; returns the clock."""
        handlers = {"engine": self.on_engine, "group": self.on_group,
                    "trained": self.on_trained, "published": self.on_published}
        self.admit(0.0)
        now = 0.0
        while len(self.step_ends) < steps:
            if not self.events:
                raise PlanError(f"the simulated loop stalled at step {len(self.step_ends) + 1} "
                                f"(mode {self.dep.mode}, groups_per_step {self.G}, buffer capacity "
                                f"{self.dep.capacity_groups}): nothing can run")
            now, _, kind, payload = heapq.heappop(self.events)
            handlers[kind](now, payload)
        return now

    # ---- admission, dispatch, training ----------------------------------------------------

    def admit(self, now: float) -> None:
        dep = self.dep
        while self.window.admits(self.version):
            lengths = dep.lengths.sample(self.rng, dep.n_samples)
            slot = self.window.open()
            self.groups[slot] = _Group(slot, lengths, dep.n_samples)
            for L in lengths:
                self.waiting.append((self.next_sample, int(L)))
                self.sample_group[self.next_sample] = slot
                self.next_sample += 1
        self.dispatch(now)

    def dispatch(self, now: float) -> None:
        dep, engines = self.dep, self.engines
        while self.wait_pos < len(self.waiting) and self.inflight < dep.max_inflight_samples:
            i = min(range(len(engines)), key=lambda k: len(engines[k].targets))
            e = engines[i]
            if len(e.targets) >= dep.max_running:
                break
            sid, L = self.waiting[self.wait_pos]
            self.wait_pos += 1
            self.inflight += 1
            g = self.groups[self.sample_group[sid]]
            if g.version < 0:
                g.version = self.version
            e.advance(now)
            e.stall += self.inp.prefill_s.value
            e.start(sid, L)
            self.schedule(i)
        if self.wait_pos > 4096:                    # keep the FIFO small
            del self.waiting[:self.wait_pos]
            self.wait_pos = 0

    def set_engine_slowdown(self, now: float, factor: float) -> None:
        for i, e in enumerate(self.engines):
            e.advance(now)
            e.slowdown = factor
            self.schedule(i)

    def try_train(self, now: float) -> None:
        G, S, inp = self.G, self.dep.max_staleness, self.inp
        if self.trainer_state != "wait" or len(self.queue) < G:
            return
        taken = []
        while len(taken) < G and self.queue:
            slot = heapq.heappop(self.queue)
            lag = self.version - self.groups[slot].version
            if lag > S + 1:                         # backstop (admission normally prevents it)
                self.stale += 1
                self.window.hand_back(slot)
                continue
            taken.append(slot)
        if len(taken) < G:
            for slot in taken:
                heapq.heappush(self.queue, slot)
            self.admit(now)
            return
        while self.waiting_room and len(self.queue) < self.dep.capacity_groups:
            heapq.heappush(self.queue, self.waiting_room.pop(0))
        tokens = 0
        for slot in taken:
            g = self.groups.pop(slot)
            self.staleness.append(self.version - g.version)
            tokens += g.tokens
        self.trainer_idle += now - self.trainer_since
        self.trainer_state = "train"
        slow = inp.train_overlap_slowdown.value if any(e.targets for e in self.engines) else 1.0
        train_s = (inp.train_fixed_s.value
                   + tokens / (inp.train_tokens_per_s.value * self.dep.train_gpus)) * slow
        if inp.engine_overlap_slowdown.value != 1.0:
            self.set_engine_slowdown(now, inp.engine_overlap_slowdown.value)
        self.push(now + train_s + inp.step_overhead_s.value, "trained")
        self.admit(now)                             # slots taken out: rule B may open

    # ---- one method per event -------------------------------------------------------------

    def on_engine(self, now: float, payload) -> None:
        i, epoch = payload
        e = self.engines[i]
        if epoch != e.epoch:
            return
        e.advance(now)
        while e.targets and e.targets[0][0] <= e.progress + 1e-9:
            sid = e.finish()
            self.inflight -= 1
            g = self.groups[self.sample_group.pop(sid)]
            g.left -= 1
            if g.left == 0:
                self.push(now + self.inp.group_overhead_s.value, "group", g.slot)
        self.schedule(i)
        self.dispatch(now)

    def on_group(self, now: float, slot: int) -> None:
        g = self.groups[slot]
        g.tokens = int(g.lengths.sum()) + self.dep.n_samples * int(self.inp.prompt_tokens.value)
        self.gen_tokens += int(g.lengths.sum())
        self.window.done(slot)
        if self.rng.random() >= self.inp.keep_fraction.value:
            self.window.hand_back(slot)
            del self.groups[slot]
        elif len(self.queue) < self.dep.capacity_groups:
            heapq.heappush(self.queue, slot)
        else:
            self.waiting_room.append(slot)
        self.admit(now)
        self.try_train(now)

    def on_trained(self, now: float, _payload) -> None:
        if self.inp.engine_overlap_slowdown.value != 1.0:
            self.set_engine_slowdown(now, 1.0)
        for i, e in enumerate(self.engines):        # the publish: every engine pauses in place
            e.advance(now)
            e.paused = True
            self.schedule(i)
        self.push(now + self.stall_s, "published")

    def on_published(self, now: float, _payload) -> None:
        for i, e in enumerate(self.engines):
            e.advance(now)
            e.paused = False
            self.schedule(i)
        self.version += 1
        self.step_ends.append(now)
        self.idle_at_step.append(self.trainer_idle)
        self.trainer_state, self.trainer_since = "wait", now
        self.admit(now)
        self.try_train(now)

    def result(self, now: float, steps: int, warmup: int) -> Result:
        engines, step_ends, idle_at_step = self.engines, self.step_ends, self.idle_at_step
        span = step_ends[-1] - step_ends[warmup - 1]
        n = len(engines)
        # the engines' idle and paused time over the whole run (its start-up counted, as measured)
        idle = sum(e.idle_s for e in engines) / n / max(now, 1e-12)
        paused = sum(e.paused_s for e in engines) / n / max(now, 1e-12)
        busy_s = sum(now - e.idle_s - e.paused_s for e in engines)
        trainer_idle_s = idle_at_step[-1] - idle_at_step[warmup - 1]
        return Result(step_s=span / (steps - warmup), trainer_idle_frac=min(1.0, trainer_idle_s / span),
                      engine_idle_frac=idle, engine_paused_frac=paused,
                      staleness_mean=float(np.mean(self.staleness)),
                      staleness_max=int(max(self.staleness)),
                      gen_tokens_per_s=self.gen_tokens / max(now, 1e-12), steps=steps,
                      stale_groups=self.stale,
                      decode_batch_mean=sum(e.batch_s for e in engines) / max(1e-12, busy_s),
                      step_times=list(np.diff(step_ends)))


def simulate(dep: Deployment, inp: Inputs, steps: int = 12, seed: int = 0, warmup: int = 1) -> Result:
    """Run the loop for `steps` training steps; figures over steps `warmup`..end (as
    bench/async_rl.py measures: from the end of step `warmup` to the end of the last)."""
    if steps <= warmup:
        raise PlanError(f"steps = {steps}: expected more than warmup = {warmup}")
    sim = _LoopSim(dep, inp, seed)
    now = sim.run(steps)
    return sim.result(now, steps, warmup)


# ----- from a recipe -------------------------------------------------------------------------------

def deployment_from_recipe(recipe, size, gpus: int | None, lengths: Lengths | None) -> Deployment:
    """The recipe's loop, buffer and rollout; engines and trainer GPUs from `--gpus` (split as
    `size.engine_share` says, engines of `size.gpus_per_engine`) or, without it, the recipe's own
    placement (one engine per `engine.num_engines`, one trainer per rank)."""
    loop, ro, eng = recipe.loop, recipe.rollout, recipe.engine
    if gpus is None:
        spec = recipe.actors.get("trainer")
        world = len(spec.nodes or [spec.node]) * spec.procs_per_node if spec else 1
        num_engines, train_gpus, per_engine = eng.num_engines, world, 1
    else:
        need = size.gpus_per_engine + size.min_train_gpus
        if gpus < need:
            raise PlanError(f"--gpus = {gpus}: model size {size.name} needs at least {need} "
                            f"({size.gpus_per_engine} for one engine + {size.min_train_gpus} to train)")
        per_engine = size.gpus_per_engine
        num_engines = max(1, int(round(gpus * size.engine_share / per_engine)))
        train_gpus = gpus - num_engines * per_engine
        if train_gpus < size.min_train_gpus:
            num_engines = (gpus - size.min_train_gpus) // per_engine
            train_gpus = gpus - num_engines * per_engine
    if lengths is None:
        lengths = lengths_from_recipe(recipe)
    return Deployment(mode=loop.mode, max_staleness=loop.staleness, groups_per_step=loop.groups_per_step,
                      n_samples=ro.n_samples_per_prompt, max_inflight_samples=ro.max_inflight_samples,
                      capacity_groups=recipe.buffer.capacity_groups, num_engines=num_engines,
                      max_running=eng.max_running_requests, gpus_per_engine=per_engine,
                      train_gpus=train_gpus, lengths=lengths)


def lengths_from_recipe(recipe) -> Lengths:
    """bench/async_rl.py's heavy-tail rollout plug-in names its distribution in its options;
    otherwise every response is assumed to run to `rollout.max_new_tokens` (an upper bound)."""
    spec = recipe.actors.get("rollout")
    opts = spec.options if spec is not None else {}
    cap = recipe.rollout.max_new_tokens
    if "median_tokens" in opts:
        median = int(opts["median_tokens"])
        return Lengths(median, 1.0, min(cap, median * int(opts.get("cap_factor", 10))),
                       f"recipe: actors.rollout.options (log-normal, median {median}, sigma 1)")
    return Lengths(cap, 0.0, cap, "assumed: every response runs to rollout.max_new_tokens "
                                  "(an upper bound; give measured lengths with --inputs)")


def lengths_from_metrics(path: str, cap: int) -> Lengths:
    """A log-normal fitted to a measured run's metrics.jsonl: its per-step mean response lengths
    (`rollout/response_len` of N = `train/samples` samples) give the mean, and their spread gives
    the per-sample variance (Var(step mean) = Var(sample) / N), so sigma^2 = ln(1 + var / mean^2)."""
    try:
        rows = [json.loads(line) for line in open(path) if line.strip()]
    except (OSError, json.JSONDecodeError) as e:
        raise PlanError(f"--lengths-from = {path}: {e}") from None
    steps = [r for r in rows if r.get("kind") == "train" and "rollout/response_len" in r]
    if len(steps) < 2:
        raise PlanError(f"--lengths-from = {path}: expected at least 2 training steps with "
                        f"rollout/response_len, found {len(steps)}")
    means = np.array([r["rollout/response_len"] for r in steps], dtype=float)
    n = float(np.mean([r.get("train/samples", 1.0) for r in steps]))
    mean = float(means.mean())
    sigma = math.sqrt(math.log1p(float(means.var(ddof=1)) * n / mean ** 2)) if mean > 0 else 0.0
    return Lengths(mean / math.exp(sigma ** 2 / 2), round(sigma, 3), cap,
                   f"{path}: log-normal fitted to {len(steps)} steps' mean response lengths "
                   f"(mean {mean:.1f} tokens, {n:.0f} samples per step)")


def plan(recipe, size_name: str, gpus: int | None = None, inputs_json: dict | None = None,
         inputs_source: str = "", steps: int = 12, seed: int = 0,
         lengths_from: Lengths | None = None) -> dict:
    MODEL_SIZES = model_sizes()
    if size_name not in MODEL_SIZES:
        raise PlanError(f"--model-size = {size_name!r}: unknown (expected one of {', '.join(MODEL_SIZES)})")
    if gpus is not None and gpus < 1:
        raise PlanError(f"--gpus = {gpus}: expected at least 1")
    size = MODEL_SIZES[size_name]
    inputs, lengths = size.inputs, size.lengths
    if inputs_json:
        inputs, given = override_inputs(inputs, inputs_json, inputs_source or "--inputs")
        lengths = given or lengths
    dep = deployment_from_recipe(recipe, size, gpus, lengths_from or lengths)
    res = simulate(dep, inputs, steps=steps, seed=seed)
    return {"plan": recipe.run.name, "model_size": size.name, "mode": dep.mode,
            "max_staleness": dep.max_staleness, "gpus": gpus,
            "engines": dep.num_engines, "gpus_per_engine": dep.gpus_per_engine, "train_gpus": dep.train_gpus,
            "samples_per_step": dep.groups_per_step * dep.n_samples,
            "step_s": round(res.step_s, 4), "trainer_idle_frac": round(res.trainer_idle_frac, 3),
            "engine_idle_frac": round(res.engine_idle_frac, 3),
            "engine_paused_frac": round(res.engine_paused_frac, 3),
            "staleness_mean": round(res.staleness_mean, 3), "staleness_max": res.staleness_max,
            "stale_groups": res.stale_groups, "decode_batch_mean": round(res.decode_batch_mean, 1),
            "gen_tokens_per_s": round(res.gen_tokens_per_s, 1), "simulated_steps": steps,
            "inputs": {k: {"value": getattr(inputs, k).value, "source": getattr(inputs, k).source}
                       for k in figure_fields()},
            "lengths": {"median": dep.lengths.median, "sigma": dep.lengths.sigma, "cap": dep.lengths.cap,
                        "source": dep.lengths.source}}


def format_table(p: dict) -> str:
    rows = [("mode", f"{p['mode']} (max_staleness {p['max_staleness']})"),
            ("deployment", f"{p['engines']} engine(s) x {p['gpus_per_engine']} GPU, {p['train_gpus']} to train"
                           + (f" ({p['gpus']} GPUs)" if p["gpus"] else " (the recipe's placement)")),
            ("samples per step", str(p["samples_per_step"])),
            ("step time", f"{p['step_s']:.4g} s"),
            ("trainer idle", f"{100 * p['trainer_idle_frac']:.1f} %"),
            ("engine idle", f"{100 * p['engine_idle_frac']:.1f} % (paused for weights "
                            f"{100 * p['engine_paused_frac']:.1f} %)"),
            ("staleness", f"mean {p['staleness_mean']:.2f}, max {p['staleness_max']}, "
                          f"{p['stale_groups']} group(s) handed back as stale"),
            ("generation", f"{p['gen_tokens_per_s']:.4g} tokens/s, mean decode batch "
                           f"{p['decode_batch_mean']:g} per engine")]
    out = [f"miles plan: {p['plan']} as model size {p['model_size']}"]
    out += [f"  {k:<18} {v}" for k, v in rows]
    out.append("  inputs:")
    for k, f in p["inputs"].items():
        out.append(f"    {k:<24} {f['value']:<12.6g} {f['source']}")
    L = p["lengths"]
    out.append(f"    {'response lengths':<24} median {L['median']:g}, sigma {L['sigma']:g}, cap {L['cap']}: {L['source']}")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    import argparse
    import sys
    ap = argparse.ArgumentParser(prog="miles plan", description="predict a deployment's step time, idle "
                                 "fractions and staleness from measured component throughputs")
    ap.add_argument("recipe")
    ap.add_argument("--gpus", type=int, default=None, help="total GPUs (engines + trainer); "
                    "without it: the recipe's own placement")
    ap.add_argument("--model-size", default=None, help="tiny, small, 0.5b, 1.5b, 7b, 744b-a40b "
                    "(default: tiny for a CPU recipe; required otherwise)")
    ap.add_argument("--inputs", default=None, help="JSON of measured figures (bench/plan_calibrate.py writes one)")
    ap.add_argument("--lengths-from", default=None, metavar="METRICS_JSONL",
                    help="response lengths fitted to a measured run's metrics.jsonl")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--steps", type=int, default=12, help="simulated training steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="one JSON line instead of the table")
    args = ap.parse_args(argv)
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        size = args.model_size or ("tiny" if recipe.engine.device == "cpu" else None)
        if size is None:
            raise PlanError(f"--model-size: required for a recipe whose engine.device = "
                            f"{recipe.engine.device!r} (the figures differ by model size)")
        data = None
        if args.inputs:
            try:
                with open(args.inputs) as f:
                    data = json.load(f)
            except (OSError, json.JSONDecodeError) as e:
                raise PlanError(f"--inputs = {args.inputs}: {e}") from None
            if not isinstance(data, dict):
                raise PlanError(f"--inputs = {args.inputs}: expected a JSON object of figures")
        lengths = (lengths_from_metrics(args.lengths_from, recipe.rollout.max_new_tokens)
                   if args.lengths_from else None)
        result = plan(recipe, size, args.gpus, data, args.inputs or "", steps=args.steps, seed=args.seed,
                      lengths_from=lengths)
    except (RecipeError, PlanError) as e:
        print(f"miles plan: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result) if args.json else format_table(result))
    return 0
