"""Workloads: the shipped GSM8K sample, any chat JSONL, random token prompts."""
from __future__ import annotations

import json

import pytest

from fluxlab.bench.scoring import final_number
from fluxlab.bench.workload import load_workload, sample_jsonl_path
from fluxlab.config import compose


class VocabTokenizer:
    all_special_ids = [0, 1, 2]

    def __len__(self):
        return 50


def test_shipped_sample_is_gsm8k_shaped_with_numeric_answers():
    lines = [json.loads(line) for line in sample_jsonl_path().read_text().splitlines()]
    assert len(lines) >= 32
    for line in lines:
        assert line["messages"][0]["role"] == "user" and line["messages"][0]["content"]
        assert final_number(line["metadata"]["answer"]) is not None


def test_default_workload_is_every_held_out_prompt_of_the_embedded_task():
    prompts = load_workload(compose("bench"))
    assert len(prompts) == 128 and all(p.answer is not None for p in prompts)
    assert len(load_workload(compose("bench", ["workload=gsm8k_sample"]))) == 32  # every shipped sample


def test_jsonl_takes_num_prompts_in_file_order_and_cycles():
    prompts = load_workload(compose("bench", ["workload=gsm8k_sample", "workload.num_prompts=40"]))
    assert len(prompts) == 40 and [p.index for p in prompts] == list(range(40))
    assert prompts[32].messages == prompts[0].messages  # 32 lines in the sample: cycled
    assert all(p.answer is not None and not p.ignore_eos for p in prompts)


def test_max_tokens_defaults_to_model_max_new_tokens_and_can_be_overridden():
    cfg = compose("bench", ["model.max_new_tokens=48"])
    assert {p.max_tokens for p in load_workload(cfg)} == {48}
    cfg = compose("bench", ["workload.max_tokens=32"])
    assert {p.max_tokens for p in load_workload(cfg)} == {32}


def test_user_jsonl_path(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 7}) + "\n")
    prompts = load_workload(compose("bench", ["workload=gsm8k", f"workload.path={path}", "workload.num_prompts=2"]))
    assert [p.messages[0]["content"] for p in prompts] == ["hi", "hi"]
    assert prompts[0].answer is None
    with pytest.raises(FileNotFoundError, match="workload.path="):
        load_workload(compose("bench", ["workload=gsm8k", f"workload.path={tmp_path / 'nope.jsonl'}"]))


def test_random_lengths_fixed_or_ranged_and_reproducible():
    tok = VocabTokenizer()
    cfg = compose("bench", ["workload=random", "workload.num_prompts=20", "workload.input_len=[5,9]",
                            "workload.output_len=[16]"])
    prompts = load_workload(cfg, tok)
    assert all(5 <= len(p.token_ids) <= 9 for p in prompts) and len({len(p.token_ids) for p in prompts}) > 1
    assert all(p.max_tokens == 16 and p.ignore_eos and p.messages is None for p in prompts)
    assert all(t not in tok.all_special_ids for p in prompts for t in p.token_ids)
    again = load_workload(cfg, tok)
    assert [p.token_ids for p in again] == [p.token_ids for p in prompts]
    other = load_workload(compose("bench", ["workload=random", "workload.seed=1", "workload.input_len=[5,9]"]), tok)
    assert [p.token_ids for p in other] != [p.token_ids for p in prompts[:len(other)]]


def test_random_max_tokens_override_and_bad_lengths():
    tok = VocabTokenizer()
    cfg = compose("bench", ["workload=random", "workload.max_tokens=32", "workload.input_len=[4]"])
    assert {p.max_tokens for p in load_workload(cfg, tok)} == {32}
    with pytest.raises(ValueError, match=r"workload.input_len=\[9, 5\]"):
        load_workload(compose("bench", ["workload=random", "workload.input_len=[9,5]"]), tok)


def test_gsm8k_fewshot_puts_the_same_exemplars_before_every_question():
    lines = [json.loads(line) for line in sample_jsonl_path().read_text().splitlines()]
    prompts = load_workload(compose("bench", ["workload=gsm8k_fewshot", "workload.num_shots=3",
                                              "workload.num_prompts=31"]))
    assert len(prompts) == 31
    shots = prompts[0].messages[:6]
    assert [m["role"] for m in shots] == ["user", "assistant"] * 3
    assert shots[0] == lines[0]["messages"][0] and shots[1]["content"] == f"The answer is {lines[0]['metadata']['answer']}."
    assert all(p.messages[:6] == shots and len(p.messages) == 7 for p in prompts)
    # questions are the lines after the exemplars, cycled; answers go with them for scoring
    assert prompts[0].messages[-1] == lines[3]["messages"][0] and prompts[0].answer == lines[3]["metadata"]["answer"]
    assert prompts[29].messages[-1] == lines[3]["messages"][0]
    with pytest.raises(ValueError, match="workload.num_shots=40"):
        load_workload(compose("bench", ["workload=gsm8k_fewshot", "workload.num_shots=40"]))


def test_chat_multiturn_turns_extend_the_previous_turn_and_come_turn_major(tmp_path):
    prompts = load_workload(compose("bench", ["workload=chat_multiturn", "workload.num_turns=3",
                                              "workload.num_prompts=6"]))
    assert [(p.metadata["turn"], p.metadata["conversation"]) for p in prompts] == [
        (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    for earlier, later in zip(prompts[:4], prompts[2:]):  # same conversation, next turn
        assert later.messages[:len(earlier.messages)] == earlier.messages
        assert [m["role"] for m in later.messages[len(earlier.messages):]] == ["assistant", "user"]
    path = tmp_path / "chats.jsonl"
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    path.write_text(json.dumps({"messages": chat}) + "\n")
    prompts = load_workload(compose("bench", ["workload=chat_multiturn", f"workload.path={path}",
                                              "workload.num_prompts=2", "workload.num_turns=2"]))
    assert [p.messages for p in prompts] == [chat[:1], chat]
