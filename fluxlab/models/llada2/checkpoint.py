"""Write random-weight LLaDA2 checkpoints in the published HF layout (`fluxlab checkpoint preset=tiny|llada2_mini|...`).

Deterministic: the same (preset, seed, dtype) gives byte-identical files on any machine (integer RNG
draws through `checkpoint_layout`, sorted JSON, the shared tiny tokenizer of fluxlab/checkpoint.py).
"""
from __future__ import annotations

from pathlib import Path

from fluxlab.checkpoint import _dump, _tiny_special_ids, _tokenizer_files

# Published LLaDA2 ids for mask/eos; the role ids are placeholders next to them.
_RELEASED_SPECIAL_IDS = {"<|endoftext|>": 156892, "<|mask|>": 156895, "<role>": 156897, "</role>": 156898,
                         "<|role_end|>": 156899}
_SHARD_BYTES = 2 * 1024**3
# LLaDA2.2 edit tokens (DESIGN §5): published ids 156930/156931; the tiny twin adds them after its specials.
EDIT_TOKENS = ["<|delete|>", "<|split|>"]
_RELEASED_EDIT_IDS = {"<|delete|>": 156930, "<|split|>": 156931}
# The tiny LLaDA2.2 twin stops on EOS and on <|role_end|> (two stop ids, like the released 156892/156900).
_TINY_LLADA22_SECOND_STOP = "<|role_end|>"


def preset_checkpoint_config(preset: str, dtype: str = "float32") -> tuple[dict, dict[str, int]]:
    """(config.json dict, special token ids) that `write_checkpoint(preset)` writes.

    tiny: vocab = its trained tokenizer (specials right after the BPE vocab); published presets:
    their vocab (157184) with the released mask/eos ids.
    """
    from fluxlab.engine.weights import resolve_dtype
    from fluxlab.models.llada2.presets import preset_config

    cfg = preset_config(preset)
    if preset == "tiny":
        special_ids = _tiny_special_ids()
        cfg["vocab_size"] = max(special_ids.values()) + 1
    elif preset == "tiny_llada22":
        special_ids = _tiny_special_ids()
        first_free = max(special_ids.values()) + 1
        special_ids.update({t: first_free + i for i, t in enumerate(EDIT_TOKENS)})
        cfg["vocab_size"] = max(special_ids.values()) + 1
    else:
        special_ids = dict(_RELEASED_SPECIAL_IDS)
        if cfg.get("delete_token_id") is not None:
            special_ids.update(_RELEASED_EDIT_IDS)
    if "<|delete|>" in special_ids:
        cfg["delete_token_id"], cfg["split_token_id"] = special_ids["<|delete|>"], special_ids["<|split|>"]
    cfg["pad_token_id"] = special_ids["<|endoftext|>"]
    cfg["torch_dtype"] = str(resolve_dtype(dtype)).removeprefix("torch.")
    return cfg, special_ids


def _generation_config(preset: str, special_ids: dict[str, int]) -> dict:
    from fluxlab.models.llada2.presets import preset_generation_config

    eos = special_ids["<|endoftext|>"]
    if preset == "tiny_llada22":
        return {"eos_token_id": [eos, special_ids[_TINY_LLADA22_SECOND_STOP]], "pad_token_id": eos}
    return preset_generation_config(preset) or {"eos_token_id": eos, "pad_token_id": eos}


def write_checkpoint(preset: str = "tiny", out=None, seed: int = 0, dtype: str = "float32",
                     shard: bool | None = None) -> Path:
    """Write config.json, safetensors (sharded with an index when large or `shard=True`),
    tokenizer files and generation_config.json for `preset` into `out`; returns the path.

    Big presets are generated and written one layer at a time, so memory stays at one layer.
    """
    import torch
    from safetensors.torch import save_file

    from fluxlab.engine.weights import resolve_dtype
    from fluxlab.models.llada2.layout import checkpoint_layout, random_tensors
    from fluxlab.models.llada2.model import LLaDA2MoeConfig

    if out is None:
        raise ValueError("write_checkpoint: out= (a directory) is required")
    out = Path(out)
    torch_dtype = resolve_dtype(dtype)
    from fluxlab.models.llada2.presets import TINY_PRESETS

    tiny = preset in TINY_PRESETS
    cfg, special_ids = preset_checkpoint_config(preset, dtype)
    config = LLaDA2MoeConfig.from_dict(cfg)

    out.mkdir(parents=True, exist_ok=True)
    files = _tokenizer_files(special_ids, cfg["max_position_embeddings"])
    files["config.json"] = _dump(cfg)
    files["generation_config.json"] = _dump(_generation_config(preset, special_ids))
    for name, text in files.items():
        (out / name).write_text(text, encoding="utf-8")

    layout = checkpoint_layout(config)
    groups = list(dict.fromkeys(slot.group for slot in layout.values()))
    elem = torch.tensor([], dtype=torch_dtype).element_size()
    total = sum(_numel(s.shape) for s in layout.values()) * elem
    if shard is None:
        shard = total > _SHARD_BYTES
    ids = random_special_ids(special_ids)
    metadata = {"format": "pt"}

    def tensors_of(group_list):
        return {n: t.to(torch_dtype).contiguous()
                for n, t in random_tensors(config, seed, peaked=tiny, special_ids=ids, groups=group_list)}

    for old in list(out.glob("model*.safetensors")) + list(out.glob("model.safetensors.index.json")):
        old.unlink()
    if not shard:
        save_file(tensors_of(None), str(out / "model.safetensors"), metadata=metadata)
        return out
    weight_map = {}
    for k, group in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = tensors_of([group])
        save_file(tensors, str(out / fname), metadata=metadata)
        weight_map.update({n: fname for n in tensors})
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(_dump(index), encoding="utf-8")
    return out


def random_special_ids(special_ids: dict[str, int]) -> dict[str, int]:
    """Token name -> id -> the roles random_tensors gives special rows (mask, eos, delete, split)."""
    roles = {"mask": "<|mask|>", "eos": "<|endoftext|>", "delete": "<|delete|>", "split": "<|split|>"}
    return {role: special_ids[tok] for role, tok in roles.items() if tok in special_ids}


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
