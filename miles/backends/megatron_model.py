"""A megatron-core GPTModel built from a Hugging Face config, and megatron's parallel state.

Design decisions:
- The HF config is the source of truth: `transformer_config_from_hf` maps one HF `model_type`
  (llama, qwen2, qwen3, qwen3_moe) to a `TransformerConfig` field by field, and refuses any other
  model type, or an HF feature we do not map (sliding windows, unknown rope scaling), by name. A
  silently wrong architecture would train and export garbage.
- The LOCAL block spec (pure megatron-core modules; megatron's own builder picks dense or MoE per
  layer from `moe_layer_freq`), so nothing needs Transformer Engine; the TE spec is used only
  when `train.megatron.use_te` allows it and transformer_engine imports. In the local spec the
  norms are ours (`_RMSNorm`): megatron's torch-norm wrapper refuses sequence parallelism.
- Core attention is ours (`PackedCoreAttention`): megatron's local `DotProductAttention` asserts
  `packed_seq_params is None` (packed sequences need TE there) and builds a CUDA causal mask. Ours
  takes megatron's thd layout and runs `miles.backends.attention`'s kernels on it: FlashAttention
  varlen on CUDA when its start-up probe passed, else one causal SDPA per sample. Each sample of a
  packed row therefore attends only to itself, and rotary positions restart per sample because
  megatron applies rope by `cu_seqlens` in thd format.
- Rotary embedding of packed (thd) rows is ours too (`_thd_rope`, patched into megatron's
  attention module): megatron's unfused thd path reads the sequence lengths to the host
  (`.tolist()`, `.item()`) and loops over the samples, twice per layer, so every layer waited for
  the GPU (measured on an H200: the 1.5B step 1.14 s with 0.84 s of kernels). Ours gathers each
  token's frequencies by its position inside its sample (positions computed on the device from
  cu_seqlens, once per micro-batch) and applies megatron's own bshd rotation once: the same
  arithmetic per token, no sync. Under context parallelism the positions come with the row's
  layout (megatron_cp.py); fused rope keeps megatron's path.
- Context parallelism is ours too (megatron_cp.py: all-gather K/V, row-level zigzag chunks), in
  the local spec only; the TE spec's CP expects TE's own per-sample layout, so cp > 1 builds the
  local spec and `use_te = true` with it is refused.
- SwiGLU is megatron's fused one (`bias_activation_fusion`, torch.compile'd) on CUDA; the CPU keeps
  the eager ops.
- RL settings are the defaults: dropout 0, no MoE aux loss (`moe_router_load_balancing_type =
  "none"`), fp32 router, `moe_router_pre_softmax = not norm_topk_prob` (top-k then softmax equals
  Qwen3-MoE's softmax, top-k, renormalize). Experts are the non-grouped `SequentialMLP`
  (`mlp.experts.local_experts.{i}.linear_fc1/fc2`), which the weight bridge maps.
- Weights are initialized (seeded) before the HF load overwrites them, because megatron sets its
  TP marks (`tensor_model_parallel`, `partition_dim`) only while initializing.
- Vocab is padded to a multiple of `make_vocab_size_divisible_by * tp` (megatron's convention).
  The padded rows are zero and their logits are NOT masked: whoever computes log-probs must slice
  the logits to `hf_config.vocab_size` (`model.miles_vocab_size` carries it).
- On a CPU-only host `megatron_cpu.apply_cpu_shims()` runs before anything is built; the
  "allgather" MoE dispatcher is chosen there (alltoall creates a CUDA stream), alltoall on GPU.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from miles.backends import attention as miles_attention
from miles.backends import megatron_cp
from miles.backends.base import RankInfo
from miles.backends.config import TrainConfig
from miles.backends.megatron_cpu import apply_cpu_shims, cpu_only

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")
DEFAULT_VOCAB_DIVISIBLE_BY = 128
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def load_hf_config(source):
    """A transformers config from a config object, or an HF directory's config.json."""
    if isinstance(source, (str, Path)):
        from transformers import AutoConfig
        return AutoConfig.from_pretrained(str(source))
    return source


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY) -> int:
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def _rope_theta(hf) -> float:
    params = getattr(hf, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(hf, "rope_theta", None))
    if theta is None:
        raise ValueError(f"model_type={hf.model_type!r}: the config has no rope_theta")
    return float(theta)


def _rope_scaling(hf) -> tuple[bool, float]:
    """(rope_scaling, factor) in megatron's terms: only llama3-style scaling with its defaults."""
    params = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return False, 8.0
    if kind == "llama3" and (params.get("low_freq_factor", 1.0), params.get("high_freq_factor", 4.0),
                             params.get("original_max_position_embeddings", 8192)) == (1.0, 4.0, 8192):
        return True, float(params.get("factor", 8.0))
    raise ValueError(f"model_type={hf.model_type!r}: rope scaling {params} is not supported by the "
                     "megatron backend (only default rope and llama3 scaling with factors 1/4/8192)")


def _moe_layer_freq(hf) -> list[int]:
    step = int(getattr(hf, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(hf, "mlp_only_layers", None) or [])
    return [int(i not in dense and (i + 1) % step == 0) for i in range(hf.num_hidden_layers)]


def transformer_config_from_hf(hf_config, train_cfg: TrainConfig):
    """The megatron `TransformerConfig` of an HF decoder config, laid out per `train_cfg.megatron`."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    hf = load_hf_config(hf_config)
    mt = getattr(hf, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type={mt!r} is not supported by the megatron backend; supported: "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    if getattr(hf, "use_sliding_window", False):
        raise ValueError(f"model_type={mt!r}: use_sliding_window=true is not supported")
    m = train_cfg.megatron
    _te_wanted(train_cfg)   # refuses use_te=true with cp > 1 by name
    dtype = _DTYPES[train_cfg.param_dtype]
    heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    sp = m.sequence_parallel if m.sequence_parallel is not None else m.tp > 1
    kw = dict(
        num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size, num_attention_heads=heads,
        num_query_groups=getattr(hf, "num_key_value_heads", None) or heads, kv_channels=head_dim,
        ffn_hidden_size=hf.intermediate_size, normalization="RMSNorm",
        layernorm_epsilon=float(hf.rms_norm_eps), gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=mt == "qwen2",
        qk_layernorm=mt in ("qwen3", "qwen3_moe"),
        hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16, attention_softmax_in_fp32=True,
        tensor_model_parallel_size=m.tp, pipeline_model_parallel_size=m.pp,
        context_parallel_size=m.cp, expert_model_parallel_size=m.ep,
        sequence_parallel=sp and m.tp > 1,
        # Initialization stays on although the weights come from the HF checkpoint: megatron marks
        # the TP-split weights (`tensor_model_parallel`, `partition_dim`) only while it initializes
        # them, and the gradient norm and optimizer read those marks.
        use_cpu_initialization=cpu_only(), perform_initialization=True,
        # Fused kernels are CUDA/apex-only; the local spec's torch ops are exact and portable.
        # SwiGLU's fusion is megatron's own (torch.compile), used on CUDA.
        bias_activation_fusion=not cpu_only(), bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
    )
    if mt != "qwen2" and getattr(hf, "attention_bias", False):
        # these models' attention_bias also puts a bias on o_proj, which megatron's
        # add_qkv_bias does not have
        raise ValueError(f"model_type={mt!r} with attention_bias=true is not supported")
    if getattr(hf, "mlp_bias", False):
        raise ValueError(f"model_type={mt!r} with mlp_bias=true is not supported")
    if mt == "qwen3_moe":
        if m.tp > 1 and not kw["sequence_parallel"]:
            raise ValueError(f"model_type='qwen3_moe' with train.megatron.tp={m.tp} needs "
                             "train.megatron.sequence_parallel=true (megatron's MoE layer refuses TP "
                             "without it in training)")
        kw.update(
            num_moe_experts=hf.num_experts, moe_router_topk=hf.num_experts_per_tok,
            moe_ffn_hidden_size=hf.moe_intermediate_size, moe_layer_freq=_moe_layer_freq(hf),
            moe_router_pre_softmax=not bool(getattr(hf, "norm_topk_prob", True)),
            moe_router_score_function="softmax", moe_router_dtype="fp32",
            moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=False, moe_permute_fusion=False,
            moe_token_dispatcher_type="allgather" if cpu_only() else "alltoall",
        )
        if getattr(hf, "shared_expert_intermediate_size", 0):
            raise ValueError("model_type='qwen3_moe' with shared experts is not supported")
    # Pipeline stages exchange activations whose sequence length changes per micro-batch (packed
    # rows); megatron's allgather MoE dispatcher (CPU) refuses this, so there PP micro-batches
    # must share one padded length.
    # (megatron checks the dispatcher type even for a dense model, which never builds one.)
    kw.setdefault("moe_token_dispatcher_type", "alltoall")
    kw["variable_seq_lengths"] = kw["moe_token_dispatcher_type"] != "allgather"
    recompute = m.recompute
    if recompute == "none" and train_cfg.gradient_checkpointing:
        recompute = "full"
    if recompute == "selective":
        kw.update(recompute_granularity="selective")
    elif recompute == "full":
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return TransformerConfig(**kw)


def _te_wanted(train_cfg: TrainConfig) -> bool:
    use_te, cp = train_cfg.megatron.use_te, train_cfg.megatron.cp
    if cp > 1:   # our context-parallel attention lives in the local spec (megatron_cp.py)
        if use_te:
            raise ValueError(f"train.megatron.cp={cp} with use_te=true: context parallelism runs on "
                             "Miles' own attention in the local layer spec; set use_te = false")
        return False
    if use_te is False:
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        if use_te:
            raise ValueError("train.megatron.use_te=true but transformer_engine does not import")
        return False
    return True


def _make_packed_core_attention():
    from megatron.core.transformer.module import MegatronModule

    class PackedCoreAttention(MegatronModule):
        """Causal core attention for megatron's sbhd and packed thd layouts (see module docstring).

        thd: q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq*D]; sbhd: q [S, B, Hq, D] -> [S, B, Hq*D]."""

        def __init__(self, config, layer_number: int, attn_mask_type=None, attention_type=None,
                     attention_dropout=None, softmax_scale=None, **_: object):
            super().__init__(config=config)
            if (attention_dropout if attention_dropout is not None else config.attention_dropout):
                raise ValueError("PackedCoreAttention: attention dropout must be 0")
            if getattr(config, "softmax_type", "vanilla") != "vanilla":
                raise ValueError(f"PackedCoreAttention: softmax_type={config.softmax_type!r}")
            self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)

        def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                    attention_bias=None, packed_seq_params=None):
            if attention_bias is not None:
                raise ValueError("PackedCoreAttention: attention_bias is not supported")
            if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
                layout = getattr(packed_seq_params, "miles_cp", None)
                if layout is not None:
                    return megatron_cp.cp_attention(query, key, value, layout, self.softmax_scale)
                return _thd_attention(query, key, value, packed_seq_params, self.softmax_scale)
            if packed_seq_params is not None:
                raise ValueError(f"PackedCoreAttention: qkv_format={packed_seq_params.qkv_format!r}; "
                                 "packed batches use 'thd'")
            s, b, hq, d = query.shape
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [B, H, S, D]
            if attention_mask is not None:
                # megatron's mask convention: True = masked out.
                rep = hq // k.shape[1]
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask.bool(),
                                                     scale=self.softmax_scale)
            else:
                out = miles_attention._sdpa_causal(q, k, v, self.softmax_scale)
            return out.permute(2, 0, 1, 3).reshape(s, b, hq * d)

    return PackedCoreAttention


def _thd_attention(q, k, v, params, scale):
    t, hq, d = q.shape
    bounds = getattr(params, "miles_bounds", None)
    if bounds is None:
        bounds = params.cu_seqlens_q.tolist()
    if q.is_cuda and getattr(miles_attention, "_varlen_fn", None) is not None:
        max_len = params.max_seqlen_q or max(b - a for a, b in zip(bounds, bounds[1:]))
        out = miles_attention.varlen_causal(q, k, v, params.cu_seqlens_q, int(max_len), scale)
    else:
        qh, kh, vh = (x.permute(1, 0, 2).unsqueeze(0) for x in (q, k, v))  # [1, H, T, D]
        out = miles_attention.segment_attention(qh, kh, vh, bounds, scale)[0].permute(1, 0, 2)
    return out.reshape(t, hq * d)


_core_attention_cls = None


def packed_core_attention_class():
    global _core_attention_cls
    if _core_attention_cls is None:
        _core_attention_cls = _make_packed_core_attention()
    return _core_attention_cls


def make_packed_seq_params(seq_lens: Sequence[int], device: torch.device | str = "cpu"):
    """megatron `PackedSeqParams` (thd) for one packed row of samples of these lengths.

    The boundaries are also kept as host ints (`miles_bounds`) so the per-sample attention path
    needs no device-to-host copy per layer."""
    from megatron.core.packed_seq_params import PackedSeqParams

    bounds = [0]
    for n in seq_lens:
        if n <= 0:
            raise ValueError(f"packed sequence lengths must be positive, got {list(seq_lens)}")
        bounds.append(bounds[-1] + int(n))
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    longest = max(seq_lens)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=longest, max_seqlen_kv=longest)
    params.miles_bounds = tuple(bounds)
    return params


class _RMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm with megatron's norm signature, usable under sequence parallelism.

    megatron's `WrappedTorchNorm` refuses sequence_parallel (without apex/TE); the norm is per
    token, so all it needs is the `sequence_parallel` mark on its weight, which megatron's
    finalize_model_grads uses to all-reduce that gradient over the TP group."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_: object):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype, device=param_device(config))
        self.weight.sequence_parallel = bool(config.sequence_parallel)


def param_device(config) -> torch.device:
    """Where megatron's own layers put a new parameter: the CPU under `use_cpu_initialization`, else
    the current CUDA device. (With device=None a norm lands on torch's default device, the CPU,
    next to megatron's CUDA linears: the H200 run's "weight is on cpu" in input_layernorm.)"""
    if config.use_cpu_initialization or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


_thd_positions: dict[int, tuple] = {}  # id(cu_seqlens) -> (weakref to it, token count, positions)


def _sample_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Each token's position inside its sample, [total] int64, on cu_seqlens' device, no host
    sync; cached per cu_seqlens tensor (every layer of a micro-batch passes the same one)."""
    import weakref
    hit = _thd_positions.get(id(cu_seqlens))
    if hit is not None and hit[0]() is cu_seqlens and hit[1] == total:
        return hit[2]
    idx = torch.arange(total, device=cu_seqlens.device)
    bounds = cu_seqlens.to(torch.int64)
    sample = torch.searchsorted(bounds[1:], idx, right=True)
    pos = idx - bounds[sample]
    for key in [k for k, v in _thd_positions.items() if v[0]() is None]:
        del _thd_positions[key]
    _thd_positions[id(cu_seqlens)] = (weakref.ref(cu_seqlens), total, pos)
    return pos


def _thd_rope(original):
    """megatron's `apply_rotary_pos_emb`, with packed (thd) rows rotated without host syncs."""
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings import rope_utils

    def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None, **kw):
        # context parallel (megatron_cp.py): this rank's tokens' positions inside their samples
        positions = getattr(cu_seqlens, "miles_positions", None)
        cp = cp_group.size() if cp_group is not None else parallel_state.get_context_parallel_world_size()
        if (cu_seqlens is None or config.apply_rope_fusion or kw.get("mla_rotary_interleaved")
                or (cp != 1 and positions is None)):
            return original(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group, **kw)
        total = t.shape[0]
        if positions is not None:
            f = freqs[positions]
        else:
            # megatron's two cases: freqs for every packed position (offsets continue), or for the
            # longest sample (positions restart per sample)
            f = freqs[:total] if freqs.shape[0] == total else freqs[_sample_positions(cu_seqlens, total)]
        return rope_utils._apply_rotary_pos_emb_bshd(
            t.unsqueeze(1), f, rotary_interleaved=config.rotary_interleaved, mscale=mscale).squeeze(1)

    apply_rotary_pos_emb.miles_thd_rope = True
    return apply_rotary_pos_emb


def _install_thd_rope() -> None:
    from megatron.core.transformer import attention
    if not getattr(attention.apply_rotary_pos_emb, "miles_thd_rope", False):
        attention.apply_rotary_pos_emb = _thd_rope(attention.apply_rotary_pos_emb)


def block_spec(config, train_cfg: TrainConfig):
    """The decoder block spec of this PP stage: local (or TE) modules; the local one gets our core
    attention and norms. megatron's builder handles dense/MoE layers (`moe_layer_freq`)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.identity_op import IdentityOp

    if _te_wanted(train_cfg):
        return specs.get_gpt_decoder_block_spec(config, use_transformer_engine=True,
                                                normalization="RMSNorm")
    _install_thd_rope()
    spec = specs.get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                            normalization="RMSNorm")
    spec.layer_norm = _RMSNorm
    for layer in spec.layer_specs:
        sub = layer.submodules
        for field in ("input_layernorm", "pre_mlp_layernorm"):
            if getattr(sub, field) is not IdentityOp:
                setattr(sub, field, _RMSNorm)
        attn = sub.self_attention.submodules
        attn.core_attention = packed_core_attention_class()
        for field in ("q_layernorm", "k_layernorm"):
            if getattr(attn, field, IdentityOp) is not IdentityOp:
                setattr(attn, field, _RMSNorm)
    return spec


def build_gpt_model(hf_config, train_cfg: TrainConfig, *, pre_process: bool | None = None,
                    post_process: bool | None = None,
                    make_vocab_size_divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY):
    """This rank's megatron `GPTModel` chunk (random init, seeded; load weights with the bridge).

    `init_parallel` must have run. pre/post_process default to whether this rank is the first/last
    pipeline stage. Parameters are on the CPU on a CPU-only host, else on the current CUDA device."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    apply_cpu_shims()
    hf = load_hf_config(hf_config)
    config = transformer_config_from_hf(hf, train_cfg)
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    rope_scaling, rope_factor = _rope_scaling(hf)
    if torch.cuda.is_available():
        miles_attention.enable_varlen_kernel(torch.device("cuda", torch.cuda.current_device()),
                                             config.params_dtype)
    model = GPTModel(
        config=config, transformer_layer_spec=block_spec(config, train_cfg),
        vocab_size=padded_vocab_size(hf.vocab_size, config.tensor_model_parallel_size,
                                     make_vocab_size_divisible_by),
        max_sequence_length=hf.max_position_embeddings, pre_process=pre_process,
        post_process=post_process, parallel_output=True,
        share_embeddings_and_output_weights=bool(hf.tie_word_embeddings),
        position_embedding_type="rope", rotary_percent=1.0, rotary_base=_rope_theta(hf),
        rope_scaling=rope_scaling, rope_scaling_factor=rope_factor)
    if not config.use_cpu_initialization:
        # As Megatron-LM's get_model does: a few megatron modules create their parameters on the
        # CPU whatever the config says (the MoE router's gate; it moves itself to the GPU lazily, in
        # its first forward, behind any optimizer's back). `.cuda()` keeps the Parameter objects and
        # their TP marks.
        model.cuda(torch.cuda.current_device())
    model.miles_vocab_size = hf.vocab_size
    model.miles_hf_config = hf
    return model


def init_parallel(train_cfg: TrainConfig, rank_info: RankInfo, timeout_s: float = 1800.0) -> torch.device:
    """Join torch.distributed (gloo on CPU, nccl on CUDA) and set up megatron's parallel groups and
    RNG seeds for `train_cfg.megatron`'s layout; returns this rank's device."""
    from megatron.core import parallel_state, tensor_parallel

    from miles.backends.distributed import init_process_group, pick_device

    m = train_cfg.megatron
    m.data_parallel(rank_info.world_size)  # refuses a layout that does not fit the world
    apply_cpu_shims()
    device = pick_device(rank_info)
    init_process_group(rank_info, device, timeout_s=timeout_s)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=m.tp, pipeline_model_parallel_size=m.pp,
        virtual_pipeline_model_parallel_size=None, context_parallel_size=m.cp,
        expert_model_parallel_size=m.ep, distributed_timeout_minutes=max(1, int(timeout_s // 60)))
    torch.manual_seed(train_cfg.seed)
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(train_cfg.seed)
    return device


def destroy_parallel() -> None:
    """Tear down megatron's groups and the default process group (each only if it exists)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
