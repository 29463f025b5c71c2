"""`fluxlab checkpoint preset=tiny_sdar` (or tiny_sdar_moe, sdar_8b, ...): a random-weight SDAR checkpoint folder.

The folder is what the published code reads: config.json with the published SDARConfig fields (model_type sdar /
sdar_moe, auto_map naming modeling_sdar.SDARForCausalLM), model.safetensors under the published tensor names (a
tied checkpoint writes no lm_head), generation_config.json whose eos_token_id list is the stop set both published
routines read, and a tokenizer. Tiny presets use fluxlab's tiny trained BPE tokenizer (its <|mask|> is the mask
token, <|endoftext|> eos/pad/bos) and peaked weights; published shapes keep their vocabulary and ids and get a
tokenizer only when the tiny one fits (it does not: they are for timing, loaded by fluxlab, not tokenised).
"""
from __future__ import annotations

import json
from pathlib import Path


def _dump(obj) -> str:
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def write_sdar_checkpoint(preset: str, out, seed: int = 0, dtype: str = "float32") -> Path:
    from safetensors.torch import save_file

    from fluxlab.checkpoint import _tiny_special_ids, tokenizer_files, train_tokenizer
    from fluxlab.engine.weights import resolve_dtype
    from fluxlab.models.sdar.loader import random_tensors
    from fluxlab.models.sdar.model import SDARConfig
    from fluxlab.models.sdar.presets import BLOCK_SIZE, EOS_TOKEN_ID, MASK_TOKEN_ID, TINY_PRESETS, preset_config

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = preset_config(preset)
    tiny = preset in TINY_PRESETS
    if tiny:
        special_ids = _tiny_special_ids()
        eos, mask = special_ids["<|endoftext|>"], special_ids["<|mask|>"]
        cfg.update(vocab_size=max(special_ids.values()) + 1, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    else:
        eos, mask = EOS_TOKEN_ID, MASK_TOKEN_ID
    cfg.update(mask_token_id=mask, block_size=BLOCK_SIZE, torch_dtype=str(resolve_dtype(dtype)).split(".")[-1])
    config = SDARConfig.from_dict(cfg)
    tensors = {name: t.to(resolve_dtype(dtype)).contiguous()
               for name, t in random_tensors(config, seed, peaked=tiny, mask_id=mask if tiny else None)}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(_dump(cfg))
    (out / "generation_config.json").write_text(_dump({"bos_token_id": eos, "eos_token_id": [eos],
                                                       "pad_token_id": eos}))
    if tiny:
        for name, content in tokenizer_files(special_ids, cfg["max_position_embeddings"], train_tokenizer()).items():
            (out / name).write_text(content, encoding="utf-8")
    return out
