"""LLaDA2 special token ids: a checkpoint folder's (tokenizer files, generation_config.json, config.json),
falling back to the released LLaDA2 ids when a file does not say."""
from __future__ import annotations

import json
from pathlib import Path

from fluxlab.engine.special_ids import SpecialIds, as_ids
from fluxlab.models.llada2.presets import EOS_TOKEN_ID, MASK_TOKEN_ID

def _ids_from_tokenizer_files(path: Path) -> tuple:
    """(mask, eos, pad) from tokenizer_config.json + tokenizer.json, without loading transformers."""
    with open(path / "tokenizer_config.json") as f:
        tc = json.load(f)
    with open(path / "tokenizer.json") as f:
        tj = json.load(f)
    ids = {t["content"]: t["id"] for t in tj.get("added_tokens", [])}
    vocab = tj.get("model", {}).get("vocab", {})

    def lookup(key):
        tok = tc.get(key)
        if isinstance(tok, dict):
            tok = tok.get("content")
        if tok is None:
            return None
        return ids.get(tok, vocab.get(tok) if isinstance(vocab, dict) else None)

    return lookup("mask_token"), lookup("eos_token"), lookup("pad_token")


def special_token_ids(path) -> tuple[int, int, int]:
    """(mask_id, eos_id, pad_id) from the checkpoint's tokenizer (its JSON files, else
    transformers' AutoTokenizer); falls back to the released LLaDA2 ids (mask 156895, eos 156892)
    and config.json's pad_token_id."""
    # None (random weights of a published preset) reads no files: Path("") would be the cwd.
    path = Path(path) if path else None
    mask_id = eos_id = pad_id = None
    if path is not None and path.is_dir():
        try:
            mask_id, eos_id, pad_id = _ids_from_tokenizer_files(path)
        except (OSError, ValueError, KeyError, TypeError):
            pass
        if mask_id is None or eos_id is None:
            try:
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
                mask_id = mask_id if mask_id is not None else tok.mask_token_id
                eos_id = eos_id if eos_id is not None else tok.eos_token_id
                pad_id = pad_id if pad_id is not None else tok.pad_token_id
                if mask_id is None and "<|mask|>" in tok.get_vocab():
                    mask_id = tok.get_vocab()["<|mask|>"]
            except Exception:
                pass
        if pad_id is None and (path / "config.json").exists():
            with open(path / "config.json") as f:
                pad_id = json.load(f).get("pad_token_id")
    mask_id = MASK_TOKEN_ID if mask_id is None else int(mask_id)
    eos_id = EOS_TOKEN_ID if eos_id is None else int(eos_id)
    pad_id = eos_id if pad_id is None else int(pad_id)
    return mask_id, eos_id, pad_id


def special_ids(path, preset: str | None = None) -> SpecialIds:
    """All special ids of a checkpoint folder: (mask, eos, pad) as `special_token_ids`, stop ids
    from generation_config.json's eos_token_id (an int or a list; LLaDA2.2 lists 156892 and
    156900) plus the tokenizer's eos, edit ids from config.json's delete_token_id/split_token_id.
    Without files (random weights of a published preset) `preset` supplies them."""
    from fluxlab.models.llada2.presets import preset_config, preset_generation_config

    path = Path(path) if path else None
    mask_id, eos_id, pad_id = special_token_ids(path)
    generation, config = None, None
    if path is not None and path.is_dir():
        if (path / "generation_config.json").exists():
            with open(path / "generation_config.json") as f:
                generation = json.load(f)
        if (path / "config.json").exists():
            with open(path / "config.json") as f:
                config = json.load(f)
    if preset is not None:
        generation = generation if generation is not None else preset_generation_config(preset)
        config = config if config is not None else preset_config(preset)
    stops = [eos_id] + as_ids((generation or {}).get("eos_token_id"))
    config = config or {}
    delete_id, split_id = config.get("delete_token_id"), config.get("split_token_id")
    return SpecialIds(mask_id, eos_id, pad_id, tuple(dict.fromkeys(stops)),
                      None if delete_id is None else int(delete_id), None if split_id is None else int(split_id))
