"""The incremental detokenizer gives the full decode's text, a window at a time."""
from __future__ import annotations

import random

import pytest

from fluxlab.engine.detokenizer import IncrementalDetokenizer
from fluxlab.engine.loading import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)  # the tiny checkpoint's byte-level BPE


def chunks(ids: list[int], rng: random.Random) -> list[list[int]]:
    out, i = [], 0
    while i < len(ids):
        n = rng.choice([1, 1, 2, 3, 16])
        out.append(ids[i:i + n])
        i += n
    return out


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_deltas_concatenate_to_the_full_decode_of_random_ids(tokenizer, skip_special_tokens):
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 120))]
        detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
        deltas = [detok.append(chunk) for chunk in chunks(ids, rng)]
        deltas.append(detok.finish())
        full = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) == detok.text == full
        assert detok.token_ids == ids


def test_a_character_split_over_tokens_is_held_back_until_complete(tokenizer):
    text = "héllo wörld ✓ 😀 done"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    for token in ids:
        delta = detok.append([token])
        assert "\ufffd" not in delta
        assert text.startswith(detok.text)
    assert detok.finish() == "" and detok.text == text


def test_the_window_stays_small_on_a_long_output(tokenizer):
    ids = tokenizer.encode("the quick brown fox jumps over the lazy dog " * 40, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    for i in range(0, len(ids), 16):
        detok.append(ids[i:i + 16])
        assert detok.read_offset - detok.prefix_offset <= 16 + 6  # one block plus context, never the output
    assert detok.text == tokenizer.decode(ids)


def test_special_tokens_are_skipped_and_an_empty_append_is_empty(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.append([]) == ""
    assert detok.append([tokenizer.convert_tokens_to_ids("<|endoftext|>")]) == ""
    assert detok.append(tokenizer.encode("ok", add_special_tokens=False)) == "ok"
