"""Checkpoint -> model: a folder's safetensors (or random values of a preset) into the stacked parameters.

Names and shapes come from layout.py's `checkpoint_layout`, which loading, random weights and the
checkpoint writer (checkpoint.py) all go through, so the three can never disagree on a name.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from fluxlab.models.llada2.model import LLaDA2MoeConfig, LLaDA2MoeModel
from fluxlab.engine.weights import resolve_dtype, safetensor_files
from fluxlab.models.llada2.layout import checkpoint_layout, random_tensor

def _expert_number(name: str) -> int:
    return int(name.split(".experts.")[1].split(".")[0])


class _Assigner:
    """Copies official tensors into a model's (possibly stacked, possibly sharded) parameters,
    checking every name. Under TP/EP each tensor is cut into pieces (target view, source index)
    that hold only this rank's shard, so a loader can read just those slices from the file."""

    def __init__(self, model: LLaDA2MoeModel):
        self.layout = checkpoint_layout(model.config)
        self.params = dict(model.named_parameters())
        self.modules = dict(model.named_modules())
        self.dims = model.dims
        self.seen: set[str] = set()

    def pieces(self, name: str) -> list[tuple[torch.Tensor, tuple | None]]:
        """(view of the parameter to fill, index into the official tensor or None for all of it)."""
        from fluxlab.engine.layers.linear import (ColumnParallelLinear, QKVParallelLinear, RowParallelLinear,
                                                  VocabParallelEmbedding)
        from fluxlab.engine.layers.moe import StackedExperts

        slot = self.layout[name]
        param = self.params[slot.param].data
        if self.dims.tp_size == 1:
            return [(param if slot.index is None else param[slot.index], None)]
        rank, all_ = self.dims.tp_rank, slice(None)
        module = self.modules[slot.param.rsplit(".", 1)[0]]
        if isinstance(module, QKVParallelLinear):
            return [(param[dst:dst + n], (slice(src, src + n),)) for dst, src, n in module.row_blocks()]
        if isinstance(module, VocabParallelEmbedding):
            lo = module.first_row
            hi = min(lo + module.shard_rows, module.vocab_size)
            return [(param[:hi - lo], (slice(lo, hi),))] if hi > lo else []
        if isinstance(module, (RowParallelLinear, ColumnParallelLinear)) and module.tp_size == 1:
            return [(param, None)]  # whole on every rank (data-parallel attention's dense layers)
        if isinstance(module, RowParallelLinear):
            n = param.shape[1]
            return [(param, (all_, slice(rank * n, (rank + 1) * n)))]
        if isinstance(module, ColumnParallelLinear):
            n = param.shape[0]
            return [(param, (slice(rank * n, (rank + 1) * n),))]
        if isinstance(module, StackedExperts):
            e, inter = _expert_number(name), module.intermediate_size
            is_down, is_up = name.endswith("down_proj.weight"), name.endswith("up_proj.weight")
            if module.ep_size > 1:  # whole experts, only this rank's
                local = e - module.first_expert
                if not 0 <= local < module.num_local_experts:
                    return []
                rows = slice(inter, 2 * inter) if is_up else slice(0, inter)
                return [(param[local] if is_down else param[local, rows], None)]
            cut = slice(rank * inter, (rank + 1) * inter)  # every expert, its intermediate slice
            if is_down:
                return [(param[e], (all_, cut))]
            return [(param[e, inter:2 * inter] if is_up else param[e, :inter], (cut,))]
        return [(param, None)]  # replicated: norms, router

    def __call__(self, name: str, shape: tuple, read):
        """`read(index)` returns the official tensor (index None) or the given slice of it."""
        slot = self.layout.get(name)
        if slot is None:
            raise ValueError(f"unexpected tensor {name!r} (shape {tuple(shape)}) in checkpoint")
        if tuple(shape) != slot.shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(shape)}, expected {slot.shape}")
        if name in self.seen:
            raise ValueError(f"tensor {name!r} appears twice in checkpoint")
        for target, index in self.pieces(name):
            target.copy_(read(index).to(device=target.device, dtype=target.dtype))
        self.seen.add(name)

    def finish(self):
        missing = [n for n in self.layout if n not in self.seen]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ValueError(f"checkpoint is missing tensor {missing[0]!r} with shape "
                             f"{self.layout[missing[0]].shape}{more}")


# ------------------------------------------------------------------------------------- loading

def read_config(path) -> LLaDA2MoeConfig:
    with open(Path(path) / "config.json") as f:
        return LLaDA2MoeConfig.from_dict(json.load(f))


def load_model(path, dtype=torch.bfloat16, device=None, progress: bool = True, dims=None):
    """config.json + safetensors (sharded or not, any float dtype on disk) -> (model, config).

    Tensors are read one at a time and copied into pre-allocated (stacked) parameters, so no
    second full copy of the weights is held. Under TP/EP (`dims`, default the process's) a rank
    reads only its slices (safetensors get_slice) and skips other ranks' experts. Missing, unexpected or wrong-shaped tensors raise a
    ValueError naming the tensor.
    """
    from safetensors import safe_open
    from tqdm import tqdm

    path = Path(path)
    config = read_config(path)
    dtype = resolve_dtype(dtype)
    device = torch.device(device) if device is not None else torch.device("cpu")
    model = LLaDA2MoeModel(config, dtype=dtype, device=device, dims=dims).eval()
    assign = _Assigner(model)
    files = safetensor_files(path)
    with tqdm(total=len(assign.layout), desc="loading weights", unit="tensor", disable=not progress) as bar:
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    tensor_slice = f.get_slice(name)  # reads only the rows/columns asked for
                    assign(name, tuple(tensor_slice.get_shape()),
                           lambda index, name=name, tensor_slice=tensor_slice:
                           f.get_tensor(name) if index is None else tensor_slice[index])
                    bar.update(1)
    assign.finish()
    return model, config


def build_random_model(preset_or_config, dtype=torch.bfloat16, device=None, seed: int = 0, peaked: bool | None = None,
                       special_ids: dict | None = None, dims=None):
    """Random weights built directly on `device`, no file. -> (model, config)

    `preset_or_config`: a preset name, a config.json dict or an LLaDA2MoeConfig. Published shapes
    get std 0.02 projections and unit norms (flat logits: every step accepts exactly the scheduled
    k). The preset "tiny" is built exactly as `fluxlab checkpoint preset=tiny` writes it (same
    vocab, peaked weights, same values for the same seed on CPU). Under TP/EP (`dims`, default the
    process's) each full tensor is generated on `device`, one at a time, and cut to this rank's
    shard, so every rank holds exactly its slice of the weights tp_size=1 would build.
    """
    if isinstance(preset_or_config, LLaDA2MoeConfig):
        config = preset_or_config
    elif isinstance(preset_or_config, dict):
        config = LLaDA2MoeConfig.from_dict(preset_or_config)
    else:
        from fluxlab.models.llada2.checkpoint import preset_checkpoint_config

        cfg, ids = preset_checkpoint_config(preset_or_config)
        config = LLaDA2MoeConfig.from_dict(cfg)
        from fluxlab.models.llada2.checkpoint import random_special_ids
        from fluxlab.models.llada2.presets import TINY_PRESETS

        if preset_or_config in TINY_PRESETS:
            peaked = True if peaked is None else peaked
            special_ids = special_ids or random_special_ids(ids)
    dtype = resolve_dtype(dtype)
    device = torch.device(device) if device is not None else torch.device("cpu")
    model = LLaDA2MoeModel(config, dtype=dtype, device=device, dims=dims).eval()
    assign = _Assigner(model)
    for name, slot in assign.layout.items():
        if not assign.pieces(name):  # another rank's experts: not even generated
            assign.seen.add(name)
            continue
        t = random_tensor(config, name, slot.shape, seed, peaked=bool(peaked), special_ids=special_ids, device=device)
        assign(name, slot.shape, lambda index, t=t: t if index is None else t[index])
        del t
    assign.finish()
    return model, config
