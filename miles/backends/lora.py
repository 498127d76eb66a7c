"""LoRA on the FSDP policy (`train.lora`): only the adapters train; engines get merged weights.

Design decisions:
- `peft.inject_adapter_in_model` puts LoRA layers into the HF module in place (no PeftModel
  wrapper), before `fully_shard`: the model keeps its class and `model.layers`, so sharding, packed
  attention and the log-prob head work unchanged. peft freezes every non-adapter parameter, and
  `build_adamw` takes only parameters that require grad, so the optimizer state is the adapters'.
  LoRA's B starts at zero (peft's default), so the adapted model starts equal to the base.
- Weights leave merged: `merged_hf_parameters` yields, under the base model's HF names, every
  parameter with each adapted linear as W + (alpha / rank) * B @ A (gathered in fp32, then cast by
  the caller's export path). Engines, HF exports and the weight checker see an ordinary dense
  checkpoint; they never learn that LoRA exists. The merge is computed per tensor from the full
  (gathered) W, A, B, so the trained modules are never modified.
- Adapters are exportable on their own: `export_adapter` writes peft's format
  (adapter_model.safetensors + adapter_config.json, names `base_model.model.<module>.lora_A.weight`),
  loadable with `peft.PeftModel.from_pretrained(base, dir)`. The backend writes `<checkpoint>/adapter`
  with every checkpoint and HF export. Resumable checkpoints hold the whole model state as usual.
- Dropout (`train.lora.dropout`) is active in every pass the trainable model runs in train mode,
  the no-grad pi_old pass included; keep it 0 (the default) when the PPO ratio matters.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from miles.backends.config import LoraConfig

ADAPTER = "default"  # peft's adapter name
ADAPTER_DIR = "adapter"


def apply_lora(lm: nn.Module, cfg: LoraConfig) -> list[str]:
    """Inject LoRA into `lm` in place; returns the adapted module names. Targets that match no
    module are refused (a typo would otherwise train nothing)."""
    import peft

    config = peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                             target_modules=list(cfg.target_modules), bias="none")
    try:
        peft.inject_adapter_in_model(config, lm, adapter_name=ADAPTER)
    except ValueError as exc:
        raise ValueError(f"train.lora.target_modules = {list(cfg.target_modules)!r}: {exc}") from None
    names = [name for name, module in lm.named_modules() if _is_lora(module)]
    if not names:
        raise ValueError(f"train.lora.target_modules = {list(cfg.target_modules)!r} matches no module")
    return names


def trainable_parameters(model: nn.Module) -> int:
    """Elements of every parameter that requires grad (global sizes: DTensor numel is global)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's state tensors over all ranks (Adam moments, step counters)."""
    return sum(v.numel() * v.element_size() for state in optimizer.state.values()
               for v in state.values() if isinstance(v, torch.Tensor))


def merged_hf_parameters(lm: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every parameter of the LoRA-injected `lm` (a CausalLM: HF names; its
    decoder: the decoder's names) with every adapter merged: an adapted linear's weight as a full
    fp32 tensor, any other parameter as it is (a shard). Collective (gathering a shard is), so
    every rank iterates to the end."""
    from miles.backends.hf_weights import _full_tensor

    lora_layers = {name: module for name, module in lm.named_modules() if _is_lora(module)}
    for name, param in lm.named_parameters():
        if ".lora_" in name:
            continue
        owner, _, leaf = name.rpartition(".base_layer.")
        if owner in lora_layers:
            layer = lora_layers[owner]
            full = _full_tensor(param, torch.float32)
            a = _full_tensor(layer.lora_A[ADAPTER].weight, torch.float32)
            b = _full_tensor(layer.lora_B[ADAPTER].weight, torch.float32)
            if leaf == "weight":
                full = full + layer.scaling[ADAPTER] * (b @ a)
            yield f"{owner}.{leaf}", full
        else:
            yield name, param


def export_adapter(lm: nn.Module, cfg: LoraConfig, out_dir: str | Path, *, write: bool,
                   base_model_path: str) -> None:
    """Write the adapters in peft's format (collective; only the rank with `write` touches disk)."""
    from safetensors.torch import save_file

    from miles.backends.hf_weights import _full_tensor

    tensors = {}
    for name, param in lm.named_parameters():
        if ".lora_" in name:
            full = _full_tensor(param, torch.float32)
            tensors["base_model.model." + name.replace(f".{ADAPTER}.", ".")] = full.contiguous().cpu()
    if not write:
        return
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    import peft
    config = peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                             target_modules=list(cfg.target_modules), bias="none",
                             base_model_name_or_path=base_model_path, task_type="CAUSAL_LM")
    config.save_pretrained(str(out))


def _is_lora(module: nn.Module) -> bool:
    return hasattr(module, "lora_A") and hasattr(module, "base_layer")
