"""The input figures of `miles plan` (`miles/plan.py`): their types, and the figures it starts
from per model size, each with its source.

Design decisions:
- A figure we measured names its bench and machine (README "Figures"); a figure scaled from one
  says how (active parameters, FLOPs, bytes); a public peer figure names its note in the shared
  reference; anything else is "assumed: <why>". `--inputs file.json` replaces any of them.
- "tiny" is the CPU quickstart's model, calibrated by `bench/plan_calibrate.py` on the 2-core CPU
  (its figures here are that script's output of 2026-12-03 on an idle machine; re-run it to
  refresh them).
- "744b-a40b" is a GLM-5-like MoE: 744B parameters, 40B active per token, FP8 engines of 8 H200
  (TP8/EP8, 744 GB of weights in 1.13 TB of HBM), bf16 training with the optimizer offloaded
  (4 bytes/parameter of weights and gradients on the GPUs: at least 32 H200).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import numpy as np


class PlanError(ValueError):
    """Input the plan cannot use; the message names the field, the value and what was expected."""


@dataclass(frozen=True)
class Figure:
    value: float
    source: str


@dataclass(frozen=True)
class Lengths:
    """Response lengths in tokens: log-normal (median, sigma) capped at `cap`, or fixed (sigma 0)."""
    median: float
    sigma: float
    cap: int
    source: str

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.sigma == 0:
            return np.full(n, min(self.cap, max(1, round(self.median))), dtype=np.int64)
        x = np.round(self.median * rng.lognormal(0.0, self.sigma, n))
        return np.clip(x, 1, self.cap).astype(np.int64)


@dataclass(frozen=True)
class Inputs:
    """Per-component figures. Times are seconds; one engine / one trainer GPU."""
    decode_fixed_s: Figure          # one decode step of one engine, fixed part
    decode_per_seq_s: Figure        # ... and per running sequence
    prefill_s: Figure               # per request (its prompt's forward and first token)
    group_overhead_s: Figure        # rollout side, per group: HTTP, rewards, PutGroup
    train_tokens_per_s: Figure      # per trainer GPU (or per trainer process on a CPU)
    train_fixed_s: Figure           # per train step, whatever its size
    publish_fixed_s: Figure         # weight stall a + b x bytes
    publish_s_per_gb: Figure
    weight_gb: Figure
    step_overhead_s: Figure         # the driver's own per step: ConfirmBatch, SetVersion, logging
    prompt_tokens: Figure
    train_overlap_slowdown: Figure  # trainer step x this while engines decode (shared cores)
    engine_overlap_slowdown: Figure  # engine step x this while the trainer trains
    keep_fraction: Figure           # groups kept by buffer.filter (the rest are handed back)
    # ... and per context token summed over the running sequences (their KV read); 0 where
    # decode_per_seq_s already holds an average context's
    decode_per_ctx_token_s: Figure = Figure(0.0, "assumed 0: decode_per_seq_s holds an average "
                                                 "context's KV read")


def figure_fields() -> list[str]:
    return list(Inputs.__dataclass_fields__)


def override_inputs(inputs: Inputs, data: dict, source: str) -> tuple[Inputs, Lengths | None]:
    """Figures from a JSON object: `{"name": value}` or `{"name": {"value": v, "source": s}}`;
    `"lengths": {"median", "sigma", "cap", "source"}` replaces the length distribution."""
    changes, lengths = {}, None
    for key, raw in data.items():
        if key == "lengths":
            try:
                lengths = Lengths(float(raw["median"]), float(raw.get("sigma", 1.0)), int(raw["cap"]),
                                  str(raw.get("source", source)))
            except (KeyError, TypeError, ValueError) as e:
                raise PlanError(f"{source}: lengths = {raw!r}: expected {{median, sigma, cap}} ({e})") from None
            continue
        if key not in Inputs.__dataclass_fields__:
            raise PlanError(f"{source}: {key} = {raw!r}: not an input figure (expected one of "
                            f"{', '.join(figure_fields())}, lengths)")
        value, src = (raw.get("value"), raw.get("source", source)) if isinstance(raw, dict) else (raw, source)
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise PlanError(f"{source}: {key} = {value!r}: expected a finite number >= 0")
        changes[key] = Figure(float(value), str(src))
    return replace(inputs, **changes), lengths


H200_HBM_BPS = 4.8e12                 # spec sheet
H200_BF16_FLOPS = 781e12              # measured dense bf16 matmul (bench/train.py's MFU reference)


@dataclass(frozen=True)
class ModelSize:
    name: str
    inputs: Inputs
    lengths: Lengths | None           # None: from the recipe
    gpus_per_engine: int
    min_train_gpus: int
    engine_share: float               # of --gpus, for the engines


def _sizes() -> dict[str, ModelSize]:
    F = Figure
    cal = ("bench/plan_calibrate.py calibration runs cal_sync / cal_async_s2 (8 groups x 4, median 24), "
           "2-core CPU, idle (load ~2, 2026-12-03; at load ~10 it was ~2x slower)")
    tiny = Inputs(
        decode_fixed_s=F(1.87e-3, f"{cal}: engine stats, ms/decode step vs batch and context fit, with the time between steps"),
        decode_per_seq_s=F(0.0494e-3, f"{cal}: engine stats, ms/decode step vs batch and context fit"),
        decode_per_ctx_token_s=F(0.9e-6, f"{cal}: engine stats, ms/decode step vs batch and context fit"),
        prefill_s=F(0.70e-3, f"{cal}: engine stats, prefill ms per request"),
        group_overhead_s=F(0.005, "assumed: rewards + PutGroup of a tiny group on the CPU, ~5 ms"),
        train_tokens_per_s=F(9315.0, f"{cal}: trainer's train/step_s over train/tokens (sync run)"),
        train_fixed_s=F(0.0, f"{cal}: step time proportional to tokens"),
        publish_fixed_s=F(0.0119, f"{cal}: weights/stall_s (1.4 MB)"),
        publish_s_per_gb=F(0.0, "assumed: 1.4 MB of weights, the fixed part dominates"),
        weight_gb=F(0.0014, "the quickstart model: 361,216 fp32 parameters"),
        step_overhead_s=F(0.0094, f"{cal}: perf/step_s - train/step_s - weights/stall_s"),
        prompt_tokens=F(5.5, f"{cal}: train/tokens per sample - rollout/response_len"),
        train_overlap_slowdown=F(1.21, f"{cal}: trainer seconds per token, fully_async over sync"),
        engine_overlap_slowdown=F(1.28, f"{cal}: engine ms/step in fully_async over the sync fit, "
                                        f"per trainer-busy share"),
        keep_fraction=F(1.0, "assumed: buffer.filter none (bench recipes); measure buffer/filtered otherwise"))

    # H200 figures we measured (README "Figures", 2026-11-30): 0.5B decode 5.17 ms/step at batch
    # 64 and 10.89 at 256 -> 3.26 ms + 0.0298 ms per sequence; 1.5B training 4 x 8k tokens in
    # 0.843 s (38.9k tokens/s, MFU 46.8%); weight publish nccl 0.022 s (1.5B, 3.1 GB) and
    # 0.054 s (7B, 15.2 GB) -> 0.0138 s + 0.00264 s/GB.
    meas = "README figures, 1x/2x H200"
    def dense(params_b: float, layers: int, prefill_ms: float) -> Inputs:
        scale = params_b / 0.5
        return Inputs(
            decode_fixed_s=F(max(3.26e-3 * layers / 24, 2 * params_b * 1e9 / H200_HBM_BPS / 0.6),
                             f"{meas}: 0.5B decode fixed 3.26 ms scaled by layers, or the weights read at "
                             f"60% of HBM bandwidth (assumed), whichever is larger"),
            decode_per_seq_s=F(0.0298e-3 * scale, f"{meas}: 0.5B 0.0298 ms/sequence scaled by parameters"),
            prefill_s=F(prefill_ms * 1e-3, f"{meas}: prefills in the loop cost 20-40 ms each for the 0.2B "
                                           f"model (~10 requests each, as in the CPU stats lines), scaled "
                                           f"by parameters"),
            group_overhead_s=F(0.005, "assumed: rewards + PutGroup, ~5 ms"),
            train_tokens_per_s=F(38.9e3 * 1.5 / params_b, f"{meas}: bench/train.py 1.5B 38.9k tokens/s "
                                                          f"(MFU 46.8%) scaled by FLOPs (6 x params)"),
            train_fixed_s=F(0.05, "assumed: launch/optimizer floor of a small step (no bench line)"),
            publish_fixed_s=F(0.0138, f"{meas}: bench/weights.py nccl, 1.5B and 7B fit a + b x bytes"),
            publish_s_per_gb=F(0.00264, f"{meas}: bench/weights.py nccl, 1.5B and 7B fit a + b x bytes"),
            weight_gb=F(2 * params_b, "bf16 weights"),
            step_overhead_s=F(0.01, "the CPU calibration's driver overhead per step"),
            prompt_tokens=F(5.5, "the quickstart's sort-digits prompts"),
            train_overlap_slowdown=F(1.0, "separate GPUs"), engine_overlap_slowdown=F(1.0, "separate GPUs"),
            keep_fraction=F(1.0, "assumed: buffer.filter none"))

    # 744B-A40B: engine decode is the weights read per step (all experts touched from a batch of
    # ~64 per engine at top-8 of 256) at 60% of HBM bandwidth, plus per sequence its KV read
    # (MLA ~70 KB/token at a 5k-token context, DeepSeek-V3-like: assumed) and 2 x 40B FLOPs at
    # 30% of peak; training at half our dense MFU (EP all-to-all, assumed) over 6 x 40B FLOPs.
    eng_gpus, fp8_bytes, active = 8, 744e9, 40e9
    kv_s = 5000 * 70e3 / (eng_gpus * H200_HBM_BPS * 0.6)
    flop_s = 2 * active / (eng_gpus * 989e12 * 0.3)
    big = Inputs(
        decode_fixed_s=F(fp8_bytes / (eng_gpus * H200_HBM_BPS * 0.6) + 3.26e-3,
                         "scaled: 744 GB of FP8 weights read per step by 8 H200 at 60% of HBM bandwidth "
                         "(assumed) + our 0.5B H200 fixed 3.26 ms"),
        decode_per_seq_s=F(kv_s + flop_s, "scaled: KV read (MLA ~70 KB/token x 5k tokens, assumed) + "
                                          "2 x 40B FLOPs at 30% of 989 TFLOP/s (assumed)"),
        prefill_s=F(2048 * 0.5 * 2 * active / (eng_gpus * 989e12 * 0.4),
                    "scaled: 2k-token prompts, half of them from the prefix cache (assumed), "
                    "2 x 40B FLOPs/token at 40% of peak"),
        group_overhead_s=F(1.0, "assumed: a verifier's reward per group, ~1 s"),
        train_tokens_per_s=F(H200_BF16_FLOPS * 0.234 / (6 * active),
                             "scaled: our H200 MFU 46.8% (bench/train.py, 1.5B dense) halved for MoE "
                             "(assumed), 6 x 40B FLOPs/token"),
        train_fixed_s=F(10.0, "assumed: optimizer step streamed from host memory (offloaded), "
                              "pipeline fill/drain; peers report minutes-long steps (shared reference: "
                              "miles_slime.md GLM-5.2 ~4.5 min/step)"),
        publish_fixed_s=F(0.5, "assumed: pause/resume and version bookkeeping across engines"),
        publish_s_per_gb=F(8.0 / 1488, "peer: GLM-5 744B P2P weight transfer 8.48 s at 16+16 nodes "
                                       "(shared reference peers.md / miles_slime.md), per GB of bf16"),
        weight_gb=F(1488.0, "744B bf16 parameters"),
        step_overhead_s=F(0.5, "assumed: driver, batch sharding to the ranks, logging"),
        prompt_tokens=F(2048.0, "assumed: agentic / reasoning prompts of ~2k tokens"),
        train_overlap_slowdown=F(1.0, "separate GPUs"), engine_overlap_slowdown=F(1.0, "separate GPUs"),
        keep_fraction=F(0.8, "assumed: dynamic sampling drops ~20% of groups"))
    long = Lengths(2048, 1.0, 32768, "assumed: reasoning/agentic responses, log-normal median 2k, "
                                     "sigma 1, cap 32k (GLM-5.2's run used 65k sequences)")
    return {
        "tiny": ModelSize("tiny", tiny, None, 1, 1, 0.5),
        "small": ModelSize("small", dense(0.2, 16, 3.0), None, 1, 1, 0.5),
        "0.5b": ModelSize("0.5b", dense(0.5, 24, 3.0 * 2.5), None, 1, 1, 0.5),
        "1.5b": ModelSize("1.5b", dense(1.5, 28, 3.0 * 7.5), None, 1, 1, 0.5),
        "7b": ModelSize("7b", dense(7.0, 28, 3.0 * 35), None, 1, 1, 0.5),
        "744b-a40b": ModelSize("744b-a40b", big, long, eng_gpus, 32, 0.5),
    }


@functools.cache
def model_sizes() -> dict[str, ModelSize]:
    return _sizes()
