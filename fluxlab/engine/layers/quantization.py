"""model.quantization=fp8: FP8 layers, the conversion of a loaded model, and FP8 checkpoints.

What is quantized (DESIGN §14, the DeepSeek-V3 / Qwen3-FP8 convention): every projection layer
(`LinearBase`: fused QKV, attention output, dense MLP, shared expert) and the routed experts
(`StackedExperts`), as e4m3 with 128x128 block scales (fluxlab/engine/layers/fp8.py). The router,
norms, embeddings and lm_head keep the model dtype.

Two ways in:
* quantize at load: `quantize_model_(model)` after the bf16 (or fp32) weights are loaded; each
  layer is quantized and its high-precision weight freed one at a time;
* an FP8 checkpoint: config.json carries `quantization_config` {"quant_method": "fp8",
  "weight_block_size": [128, 128], ...} and every quantized `X.weight` is e4m3 beside its fp32
  `X.weight_scale_inv` ([ceil(out/128), ceil(in/128)]); fluxlab/models/llada2/fp8_checkpoint.py reads it into a model
  converted with `fp8_structure_` (the empty FP8 layers) and writes one from a
  bf16 checkpoint folder, with the quantizer here.

`quantize_model_` / `fp8_structure_` convert the block engine's layers (LinearBase, StackedExperts).
Diffusion-Gemma has layers of its own and converts them itself with `Fp8Linear` and `fp8_moe`
(fluxlab/models/diffusion_gemma/fp8_checkpoint.py).

One GPU only for now: the block scales are not cut for tensor or expert parallel shards.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from fluxlab.engine.layers.fp8 import BLOCK, FP8_DTYPE, fp8_linear, fp8_moe, num_blocks, quantize_blocks, quantize_stacked

QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [BLOCK, BLOCK]}


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class Fp8Linear(nn.Module):
    """A bias-free projection with an e4m3 weight [out, in] and its `weight_scale_inv` blocks."""

    def __init__(self, out_features: int, in_features: int, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _param(torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device))
        self.weight_scale_inv = _param(torch.empty(num_blocks(out_features), num_blocks(in_features),
                                                   dtype=torch.float32, device=device))

    @classmethod
    @torch.no_grad()
    def quantized(cls, weight: torch.Tensor) -> "Fp8Linear":
        """The FP8 layer of a high-precision weight [out, in] (quantized per 128x128 block)."""
        layer = cls(*weight.shape, device="meta")
        q, s = quantize_blocks(weight)
        layer.weight, layer.weight_scale_inv = _param(q), _param(s)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale_inv)


class Fp8StackedExperts(nn.Module):
    """`StackedExperts` (one GPU) with e4m3 weights: w_gate_up [E, 2I, H] with its scales
    [E, 2*ceil(I/128), ceil(H/128)] (gate blocks, then up blocks) and w_down [E, H, I] with
    [E, ceil(H/128), ceil(I/128)]. CUDA: the Triton FP8 fused MoE; CPU: its dequantize reference."""

    partial = False

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, device=None):
        super().__init__()
        self.num_experts = self.num_local_experts = num_experts
        self.first_expert, self.intermediate_size, self.ep_size = 0, intermediate_size, 1
        nb, hb = num_blocks(intermediate_size), num_blocks(hidden_size)
        self.w_gate_up = _param(torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=FP8_DTYPE,
                                            device=device))
        self.w_gate_up_scale_inv = _param(torch.empty(num_experts, 2 * nb, hb, dtype=torch.float32, device=device))
        self.w_down = _param(torch.empty(num_experts, hidden_size, intermediate_size, dtype=FP8_DTYPE, device=device))
        self.w_down_scale_inv = _param(torch.empty(num_experts, hb, nb, dtype=torch.float32, device=device))

    # Whether the last stacked expert is the layer's shared expert (`fuse_shared_experts_`): then the
    # routing's last column is every token's slot of it, weight 1 (`route_logits(shared_id=...)`).
    shared = False

    def forward(self, x, topk_idx, topk_weight, adds: tuple = ()):
        return fp8_moe(x, topk_idx, topk_weight, self.w_gate_up, self.w_gate_up_scale_inv, self.w_down,
                       self.w_down_scale_inv, adds=adds, shared_last=self.shared)


def _targets(model: nn.Module):
    """(parent, attribute, module) of every layer FP8 replaces, in module order."""
    from fluxlab.engine.layers.linear import LinearBase
    from fluxlab.engine.layers.moe import StackedExperts

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, (LinearBase, StackedExperts)):
                yield parent, name, child


def check_supported(model: nn.Module) -> None:
    dims = getattr(model, "dims", None)
    if dims is not None and (dims.tp_size > 1 or dims.ep_size > 1):
        raise ValueError("model.quantization=fp8 runs on one GPU (parallel.tp_size=1, ep_size=1): the 128x128 "
                         "block scales are not cut into tensor- or expert-parallel shards yet")


def _empty_like_fp8(module: nn.Module, device) -> nn.Module:
    from fluxlab.engine.layers.moe import StackedExperts

    if isinstance(module, StackedExperts):
        e, two_i, h = module.w_gate_up.shape
        return Fp8StackedExperts(e, h, two_i // 2, device)
    out_features, in_features = module.weight.shape
    return Fp8Linear(out_features, in_features, device)


def _unstack(model: nn.Module) -> None:
    """The MoE block's one-GEMM path multiplies a bf16 stack of the shared expert's gate/up and the
    router; with FP8 shared experts the router gets its own weight back and the block the plain path."""
    for module in model.modules():
        if getattr(module, "stacked", None) is not None:
            module.gate.weight = _param(module.gate.weight.data.clone())
            module.stacked = None


def fp8_structure_(model: nn.Module) -> nn.Module:
    """Replace every quantized layer by its empty FP8 twin (to load an FP8 checkpoint into)."""
    check_supported(model)
    _unstack(model)
    for parent, name, child in list(_targets(model)):
        device = (child.w_gate_up if hasattr(child, "w_gate_up") else child.weight).device
        setattr(parent, name, _empty_like_fp8(child, device))
    return model


@torch.no_grad()
def quantize_model_(model: nn.Module) -> nn.Module:
    """Quantize a loaded model's projections and experts in place (module doc)."""
    check_supported(model)
    _unstack(model)
    for parent, name, child in list(_targets(model)):
        if hasattr(child, "w_gate_up"):
            e, two_i, h = child.w_gate_up.shape
            fp8 = Fp8StackedExperts(e, h, two_i // 2, device="meta")
            q, s = quantize_stacked(child.w_gate_up.data, 2)   # gate and up each on its own block grid
            fp8.w_gate_up, fp8.w_gate_up_scale_inv = _param(q), _param(s)
            q, s = quantize_blocks(child.w_down.data)
            fp8.w_down, fp8.w_down_scale_inv = _param(q), _param(s)
        else:
            fp8 = Fp8Linear.quantized(child.weight.data)
        setattr(parent, name, fp8)
        del child
    return model


@torch.no_grad()
def fuse_shared_experts_(model: nn.Module) -> nn.Module:
    """Stack each MoE block's FP8 shared expert under its routed experts, as expert E, and drop the
    block's `shared_experts`: the shared expert then runs inside the fused MoE's launches, as every
    token's last slot (weight 1, added after the routed sum as `adds[0]` was), instead of its own
    quantizations, three GEMMs and an activation (seven launches a layer at decode, where launches
    dominate). Its numbers become a routed expert's: gate and up stay fp32 into the activation (the
    separate path rounded each to the model dtype first). Only where the shared expert's width is
    the experts' (one shared expert); other blocks keep the separate path."""
    for block in list(model.modules()):
        experts, shared = getattr(block, "experts", None), getattr(block, "shared_experts", None)
        if not isinstance(experts, Fp8StackedExperts) or experts.shared or shared is None:
            continue
        parts = [getattr(shared, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
        if not all(isinstance(p, Fp8Linear) for p in parts) or parts[0].out_features != experts.intermediate_size:
            continue
        gate, up, down = parts
        experts.w_gate_up = _param(torch.cat([experts.w_gate_up, torch.cat([gate.weight, up.weight])[None]]))
        experts.w_gate_up_scale_inv = _param(torch.cat([experts.w_gate_up_scale_inv, torch.cat(
            [gate.weight_scale_inv, up.weight_scale_inv])[None]]))
        experts.w_down = _param(torch.cat([experts.w_down, down.weight[None]]))
        experts.w_down_scale_inv = _param(torch.cat([experts.w_down_scale_inv, down.weight_scale_inv[None]]))
        experts.shared = True
        block.shared_experts = None
    return model


def fp8_checkpoint(path) -> bool:
    """Whether a checkpoint folder's config.json says its weights are block-scaled FP8."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    q = json.loads(config.read_text()).get("quantization_config") or {}
    if not q:
        return False
    if q.get("quant_method") != "fp8" or list(q.get("weight_block_size") or []) != [BLOCK, BLOCK]:
        raise ValueError(f"{config}: quantization_config {q} is not the block-scaled FP8 layout fluxlab reads "
                         f"(quant_method fp8, weight_block_size [{BLOCK}, {BLOCK}])")
    return True


@torch.no_grad()
def write_fp8_folder(src, dst, quantize: Callable[[str, torch.Tensor], Optional[tuple[torch.Tensor, torch.Tensor]]]
                     ) -> Path:
    """A bf16/fp32 checkpoint folder -> its FP8 twin in one model.safetensors: `quantize(name, tensor)` gives
    (e4m3, weight_scale_inv), stored as name and name + "_scale_inv", or None to keep the tensor as it is
    (each family says which of its tensors are quantized, and how). Other files are copied; config.json
    gains QUANTIZATION_CONFIG."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from fluxlab.engine.weights import safetensor_files

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for file in safetensor_files(src):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                quantized = quantize(name, t)
                if quantized is None:
                    tensors[name] = t.contiguous()
                else:
                    tensors[name], tensors[name + "_scale_inv"] = quantized
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for item in src.iterdir():
        if item.is_file() and item.suffix != ".safetensors" and item.name != "model.safetensors.index.json":
            shutil.copy(item, dst / item.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = dict(QUANTIZATION_CONFIG)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst

