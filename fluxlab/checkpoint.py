"""Write random-weight LLaDA2 checkpoints in the published HF layout (`fluxlab checkpoint`).

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
# Published LLaDA2 ids for mask/eos; the role ids are placeholders next to them.
_RELEASED_SPECIAL_IDS = {"<|endoftext|>": 156892, "<|mask|>": 156895, "<role>": 156897, "</role>": 156898,
                         "<|role_end|>": 156899}
_SHARD_BYTES = 2 * 1024**3
# LLaDA2.2 edit tokens (DESIGN §5): published ids 156930/156931; the tiny twin adds them after its specials.
EDIT_TOKENS = ["<|delete|>", "<|split|>"]
_RELEASED_EDIT_IDS = {"<|delete|>": 156930, "<|split|>": 156931}
# The tiny LLaDA2.2 twin stops on EOS and on <|role_end|> (two stop ids, like the released 156892/156900).
_TINY_LLADA22_SECOND_STOP = "<|role_end|>"

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


def preset_checkpoint_config(preset: str, dtype: str = "float32") -> tuple[dict, dict[str, int]]:
    """(config.json dict, special token ids) that `write_checkpoint(preset)` writes.

    tiny: vocab = its trained tokenizer (specials right after the BPE vocab); published presets:
    their vocab (157184) with the released mask/eos ids.
    """
    from fluxlab.engine.loader import resolve_dtype
    from fluxlab.engine.presets import preset_config

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
    from fluxlab.engine.presets import preset_generation_config

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

    from fluxlab.engine.loader import checkpoint_layout, random_tensors, resolve_dtype
    from fluxlab.engine.models.llada2_moe import LLaDA2MoeConfig

    if out is None:
        raise ValueError("write_checkpoint: out= (a directory) is required")
    from fluxlab.checkpoint_diffusion_gemma import PRESET as DIFFUSION_GEMMA_PRESET

    if preset == DIFFUSION_GEMMA_PRESET:  # written by transformers' own classes (checkpoint_diffusion_gemma.py)
        from fluxlab.checkpoint_diffusion_gemma import write_diffusion_gemma_checkpoint

        return write_diffusion_gemma_checkpoint(out, seed=seed, dtype=dtype)
    out = Path(out)
    torch_dtype = resolve_dtype(dtype)
    from fluxlab.engine.presets import TINY_PRESETS

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


def _source_digest() -> str:
    """Hash of what determines the tiny checkpoint: corpus + the code that writes it."""
    h = hashlib.sha256(f"v{TINY_VERSION}".encode())
    here = Path(__file__).parent
    for p in [corpus_path(), Path(__file__), here / "engine" / "loader.py", here / "engine" / "presets.py",
              here / "checkpoint_diffusion_gemma.py"]:
        h.update(p.read_bytes())
    return h.hexdigest()[:12]


def default_cache_dir() -> Path:
    return Path(os.environ.get("FLUXLAB_CACHE") or Path.home() / ".cache" / "fluxlab")


def ensure_tiny_checkpoint(cache_dir=None, preset: str = "tiny") -> Path:
    """Path of the tiny checkpoint, written once into <cache>/tiny_llada2-<digest> and reused
    (preset="tiny_llada22": the tiny LLaDA2.2 twin, in <cache>/tiny_llada22-<digest>).

    Safe under concurrent callers: each writes into its own temporary folder and renames it into
    place atomically; a loser of the race discards its copy and uses the winner's.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    from fluxlab.checkpoint_diffusion_gemma import PRESET as DIFFUSION_GEMMA_PRESET
    from fluxlab.engine.presets import TINY_PRESETS

    if preset not in TINY_PRESETS + (DIFFUSION_GEMMA_PRESET,):
        raise ValueError(f"ensure_tiny_checkpoint: preset {preset!r} is not one of "
                         f"{TINY_PRESETS + (DIFFUSION_GEMMA_PRESET,)}")
    name = "tiny_llada2" if preset == "tiny" else preset
    final = cache / f"{name}-{_source_digest()}"
    if (final / "config.json").exists():
        return final
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-tmp-", dir=cache))
    try:
        write_checkpoint(preset, tmp, seed=0, dtype="float32")
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
