"""The embedded model's tokenizer: a small byte-level BPE trained on the task's own text.

Digits are split one per token (as LLaMA and Qwen tokenizers do), so a model can learn addition
digit by digit and carry, and unseen numbers are no new tokens. Special tokens, chat template and
the tokenizer_config.json come from fluxlab/checkpoint.py, the same as the tiny checkpoint's.
"""
from __future__ import annotations

import json
import random

from fluxlab.checkpoint import SPECIAL_TOKENS
from fluxlab.train.task import problems

VOCAB_SIZE = 512
CORPUS_PROBLEMS = 20000


def corpus_lines(seed: int, num: int = CORPUS_PROBLEMS) -> list[str]:
    """Train-split questions and replies: the text the tokenizer learns its merges from."""
    gen = problems(seed, "train")
    lines = []
    for _ in range(num):
        p = next(gen)
        lines += [p.question, p.reply]
    # The chat roles as whole words, so a prompt's role markers are one token each.
    lines += ["SYSTEM", "HUMAN", "ASSISTANT"] * 100
    random.Random(seed).shuffle(lines)
    return lines


def train_task_tokenizer(seed: int, vocab_size: int = VOCAB_SIZE) -> tuple[str, dict[str, int]]:
    """-> (tokenizer.json text, special token ids). Specials follow the learned vocab, in
    SPECIAL_TOKENS order. Deterministic: a seeded corpus, and the BPE trainer breaks count ties by
    pair order (the same file for RAYON_NUM_THREADS 1 and 4, checked), so encoding may stay parallel."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus_lines(seed), trainer)
    spec = json.loads(tok.to_str())
    base = len(spec["model"]["vocab"])
    special_ids = {t: base + i for i, t in enumerate(SPECIAL_TOKENS)}
    spec["model"]["vocab"].update(special_ids)
    spec["added_tokens"] = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": True} for t, i in sorted(special_ids.items(), key=lambda kv: kv[1])]
    return Tokenizer.from_str(json.dumps(spec)).to_str(), special_ids
