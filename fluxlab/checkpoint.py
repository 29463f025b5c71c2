"""`fluxlab checkpoint`: random-weight checkpoints of any family, the shared tiny tokenizer, and the
cached tiny checkpoints tests and the default run use (each family writes its own files: `Family.hooks()`).

Everything is deterministic: the same (preset, seed, dtype) gives byte-identical files on any
machine (integer RNG draws, sorted JSON, a BPE trained single-threaded on a fixed corpus).
Importable without hydra; torch, safetensors and tokenizers are imported inside the functions.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

TINY_VERSION = 1  # bump when the tiny checkpoint's content changes (cache folder name follows)
SPECIAL_TOKENS = ["<|endoftext|>", "<|mask|>", "<role>", "</role>", "<|role_end|>"]
# Ling-2.0 style: <role>SYSTEM</role>…<|role_end|><role>HUMAN</role>…<|role_end|><role>ASSISTANT</role>
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{- '<role>SYSTEM</role>' + message['content'] + '<|role_end|>' -}}"
    "{%- elif message['role'] == 'user' -%}{{- '<role>HUMAN</role>' + message['content'] + '<|role_end|>' -}}"
    "{%- elif message['role'] == 'assistant' -%}{{- '<role>ASSISTANT</role>' + message['content'] + '<|role_end|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<role>ASSISTANT</role>' -}}{%- endif -%}"
)


def corpus_path() -> Path:
    return Path(__file__).parent / "assets" / "tiny_corpus.txt"


def _dump(obj) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def train_tokenizer(special_ids: dict[str, int] | None = None, vocab_size: int = 4096) -> str:
    """Byte-level BPE trained on fluxlab/assets -> tokenizer.json text.

    Special tokens get `special_ids` (default: right after the learned vocab, in SPECIAL_TOKENS
    order). Training is single-threaded-equivalent: tokenizers' BPE trainer breaks count ties by
    pair order, and we verified identical output for RAYON_NUM_THREADS 1/2/8.
    """
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(corpus_path())], trainer)
    spec = json.loads(tok.to_str())
    base = len(spec["model"]["vocab"])
    if special_ids is None:
        special_ids = {t: base + i for i, t in enumerate(SPECIAL_TOKENS)}
    # Put the specials in the model vocab too, so explicit (even non-contiguous) ids are kept.
    spec["model"]["vocab"].update(special_ids)
    spec["added_tokens"] = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": True} for t, i in sorted(special_ids.items(), key=lambda kv: kv[1])]
    return Tokenizer.from_str(json.dumps(spec)).to_str()


def _tokenizer_files(special_ids: dict[str, int], max_len: int) -> dict[str, str]:
    return tokenizer_files(special_ids, max_len, train_tokenizer(special_ids))


def tokenizer_files(special_ids: dict[str, int], max_len: int, tokenizer_json: str) -> dict[str, str]:
    """tokenizer.json, tokenizer_config.json (chat template, mask/eos) and special_tokens_map.json
    texts for a tokenizer whose specials are SPECIAL_TOKENS at `special_ids` (also the embedded model's)."""
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": True} for t, i in special_ids.items()}
    tok_config = {
        "add_bos_token": False, "add_eos_token": False, "added_tokens_decoder": added,
        "additional_special_tokens": ["<role>", "</role>", "<|role_end|>"],
        "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>", "mask_token": "<|mask|>", "pad_token": "<|endoftext|>",
        "model_max_length": max_len, "tokenizer_class": "PreTrainedTokenizerFast",
    }
    special_map = {"additional_special_tokens": ["<role>", "</role>", "<|role_end|>"], "eos_token": "<|endoftext|>",
                   "mask_token": "<|mask|>", "pad_token": "<|endoftext|>"}
    return {"tokenizer.json": tokenizer_json, "tokenizer_config.json": _dump(tok_config),
            "special_tokens_map.json": _dump(special_map)}


def _tiny_special_ids() -> dict[str, int]:
    spec = json.loads(train_tokenizer())
    return {t["content"]: t["id"] for t in spec["added_tokens"]}


def _source_digest(preset: str) -> str:
    """Hash of what determines the tiny checkpoint: corpus + the code that writes it."""
    h = hashlib.sha256(f"v{TINY_VERSION}".encode())
    for p in [corpus_path(), Path(__file__), *sorted(_family_dir(preset).glob("*.py"))]:
        h.update(p.read_bytes())
    return h.hexdigest()[:12]


def _family_dir(preset: str) -> Path:
    """The package of the family that writes `preset` (its model, layout and writer decide the files)."""
    from fluxlab.models.registry import family_of_preset

    return Path(__file__).parent / "models" / family_of_preset(preset).package.rsplit(".", 1)[-1]


def default_cache_dir() -> Path:
    return Path(os.environ.get("FLUXLAB_CACHE") or Path.home() / ".cache" / "fluxlab")


def ensure_tiny_checkpoint(cache_dir=None, preset: str = "tiny") -> Path:
    """Path of the tiny checkpoint, written once into <cache>/tiny_llada2-<digest> and reused
    (preset="tiny_llada22": the tiny LLaDA2.2 twin, in <cache>/tiny_llada22-<digest>).

    Safe under concurrent callers: each writes into its own temporary folder and renames it into
    place atomically; a loser of the race discards its copy and uses the winner's.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    from fluxlab.models.registry import TINY_PRESETS, family_of_preset

    if preset not in TINY_PRESETS:
        raise ValueError(f"ensure_tiny_checkpoint: preset {preset!r} is not one of {TINY_PRESETS}")
    name = "tiny_llada2" if preset == "tiny" else preset
    final = cache / f"{name}-{_source_digest(preset)}"
    if (final / "config.json").exists():
        return final
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-tmp-", dir=cache))
    try:
        family_of_preset(preset).hooks().write_checkpoint(preset, tmp, seed=0, dtype="float32")
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def write_checkpoint(preset: str = "tiny", out=None, seed: int = 0, dtype: str = "float32") -> Path:
    """Write `preset`'s checkpoint folder into `out` (the family of the preset writes it)."""
    from fluxlab.models.registry import PRESETS, family_of_preset

    family = family_of_preset(preset)
    if family is None:
        raise ValueError(f"preset={preset!r} is not a preset of any model family; use one of {', '.join(PRESETS)}")
    if out is None:
        raise ValueError("write_checkpoint: out= (a directory) is required")
    return family.hooks().write_checkpoint(preset, out, seed=seed, dtype=dtype)
