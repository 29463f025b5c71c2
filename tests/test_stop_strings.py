"""Stop strings are always honoured: the earliest of stop string, EOS and length ends a request, and
the text, token ids, completion token count and finish_reason all say the same, for every decoder,
offline, streamed and through HTTP.

The embedded arith_llada2 model (fp32, greedy) answers "What is 3 + 4?" with ANSWER below, then EOS,
in the block that holds the answer's end; the random tiny models are checked against the same cut
taken over their whole unstopped output (`cut_at`).
"""
from __future__ import annotations

import functools
import json

import httpx
import pytest

from fluxlab import LLM, SamplingParams
from fluxlab.server.output_text import StreamText

BASE = ["engine.dtype=float32", "engine.device=cpu"]
QUESTION = [{"role": "user", "content": "What is 3 + 4?"}]  # 15 prompt tokens
# '3', ' +', ' ', '4', ' =', ' ', '7', '.', ' The', ' answer', ' is', ' ', '7', '.'
ANSWER_IDS = [18, 272, 220, 19, 259, 220, 22, 13, 267, 268, 263, 220, 22, 13]
ANSWER = "3 + 4 = 7. The answer is 7."
# 16 prompt tokens: with blocks of 16 the answer fills block 1 up to "...answer is 5", block 2 holds "0." and EOS
SPANNING = [{"role": "user", "content": "Compute 72 - 22."}]
# '7', '2', ' -', ' ', '2', '2', ' =', ' ', '5', '0', '.', ' The', ' answer', ' is', ' ', '5', '0', '.'
SPANNING_IDS = [22, 17, 275, 220, 17, 17, 259, 220, 20, 15, 13, 267, 268, 263, 220, 20, 15, 13]
EOS = 484


@functools.lru_cache(maxsize=None)
def engine_llm(*overrides: str) -> LLM:
    return LLM(overrides=BASE + list(overrides))


def generate(llm: LLM, prompt, **params):
    [result] = llm.generate([prompt], SamplingParams(**params))
    return result


def cut_at(tokenizer, ids: list[int], stops: list[str]) -> tuple[list[int], str]:
    """The stop rule over a whole output: text up to the first stop string, ids up to the token
    whose text reaches it."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    cut = min(text.index(s) for s in stops if s in text)
    n = next(n for n in range(len(ids) + 1) if len(tokenizer.decode(ids[:n], skip_special_tokens=True)) > cut)
    return ids[:n], text[:cut]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


# ------------------------------------------------------------------------------ the embedded model

LLADA_DECODERS = ["threshold", "hierarchy", "joint_threshold", "joint_threshold_speed"]


@pytest.mark.parametrize("decoding", LLADA_DECODERS)
def test_a_stop_string_before_eos_in_the_same_block_wins(decoding):
    llm = engine_llm(f"decoding={decoding}")
    plain = generate(llm, QUESTION)
    assert (plain.text, plain.token_ids, plain.finish_reason) == (ANSWER, ANSWER_IDS, "stop")  # EOS, nothing cut
    got = generate(llm, QUESTION, stop=["answer"])
    assert got.text == "3 + 4 = 7. The "
    assert got.token_ids == ANSWER_IDS[:10]  # through ' answer', the token the stop string starts in
    assert got.finish_reason == "stop"
    assert got.stats.blocks_committed == plain.stats.blocks_committed


@pytest.mark.parametrize("decoding", LLADA_DECODERS)
def test_the_earliest_of_several_stop_strings_wins(decoding):
    got = generate(engine_llm(f"decoding={decoding}"), QUESTION, stop=["is", "answer", "= 7"])
    assert (got.text, got.token_ids, got.finish_reason) == ("3 + 4 ", ANSWER_IDS[:5], "stop")


def test_a_stop_string_at_the_very_first_token():
    got = generate(engine_llm(), QUESTION, stop=["3"])
    assert (got.text, got.token_ids, got.finish_reason) == ("", [18], "stop")


def test_a_stop_string_past_eos_does_not_count(monkeypatch):
    llm = engine_llm()
    # ' The' as a second EOS id: the output ends before it, so "answer" lies past EOS.
    monkeypatch.setattr(llm.engine, "eos_ids", (EOS, 267))
    got = generate(llm, QUESTION, stop=["answer", "7. T"])
    assert (got.text, got.token_ids, got.finish_reason) == ("3 + 4 = 7.", ANSWER_IDS[:8], "stop")
    got = generate(llm, QUESTION, stop=["answer", "= 7"])
    assert (got.text, got.token_ids, got.finish_reason) == ("3 + 4 ", ANSWER_IDS[:5], "stop")


def test_a_stop_string_before_the_length_cut_wins_and_one_past_it_does_not():
    llm = engine_llm()
    got = generate(llm, QUESTION, max_new_tokens=12, stop=["answer"])
    assert (got.text, got.token_ids, got.finish_reason) == ("3 + 4 = 7. The ", ANSWER_IDS[:10], "stop")
    got = generate(llm, QUESTION, max_new_tokens=9, stop=["answer"])
    assert (got.text, got.token_ids, got.finish_reason) == ("3 + 4 = 7. The", ANSWER_IDS[:9], "length")


def test_ignore_eos_keeps_stop_strings():
    llm = engine_llm()
    got = generate(llm, QUESTION, ignore_eos=True, max_new_tokens=40, stop=["answer"])
    assert (got.text, got.token_ids, got.finish_reason) == ("3 + 4 = 7. The ", ANSWER_IDS[:10], "stop")
    got = generate(llm, QUESTION, ignore_eos=True, max_new_tokens=40, stop=["7. X"])
    assert (got.text, got.token_ids, got.finish_reason) == (ANSWER, ANSWER_IDS + [EOS] * 26, "length")


def test_a_stop_string_spanning_two_blocks_before_eos():
    llm = engine_llm("decoding.block_length=16")
    plain = generate(llm, SPANNING)
    assert (plain.token_ids, plain.finish_reason, plain.stats.blocks_committed) == (SPANNING_IDS, "stop", 2)
    # "is 5" is in block 1, "0." and EOS in block 2; block 1's 16 ids were reported before the stop was seen
    got = generate(llm, SPANNING, stop=["is 50."])
    assert (got.text, got.token_ids, got.finish_reason) == ("72 - 22 = 50. The answer ", SPANNING_IDS[:16], "stop")
    got = generate(llm, QUESTION, stop=["3 +"])  # block 0 holds "3" alone, block 1 the rest and EOS
    assert (got.text, got.token_ids, got.finish_reason) == ("", [18], "stop")


@pytest.mark.parametrize("prompt, stop", [(SPANNING, ["is 50."]), (SPANNING, ["answer"]), (QUESTION, ["3 +"]),
                                          (SPANNING, ["50. T", "22 ="])])
def test_streamed_text_never_runs_past_the_stop(prompt, stop):
    """What the server streams (StreamText over each block's output) adds up to the final text, and
    no chunk holds text the final answer cuts."""
    llm = engine_llm("decoding.block_length=16")
    engine = llm.engine
    request_id = engine.add_request(llm.encode(prompt), SamplingParams(stop=stop))
    stream, deltas, ids, last = StreamText(llm.tokenizer, stop), [], [], None
    while last is None:
        for out in engine.step():
            assert out.request_id == request_id
            deltas.append(stream.delta(out))
            ids += out.new_token_ids
            last = out if out.finished else None
    assert "".join(deltas) == last.text and not any(s in last.text for s in stop)
    assert ids == last.token_ids and last.finish_reason == "stop"


# ------------------------------------------------------------------------------ the tiny random models

def test_levenshtein_joint_cuts_at_a_stop_string_before_eos():
    llm = engine_llm("model=tiny_llada22", "decoding=levenshtein_joint", "decoding.block_length=16")
    prompt = [100, 200, 300]  # the answer and its EOS fall in the first block
    plain = generate(llm, prompt, max_new_tokens=13)
    assert plain.finish_reason == "stop" and plain.stats.blocks_committed == 1 and len(plain.token_ids) >= 2
    stop = llm.tokenizer.decode(plain.token_ids[1:2])
    want_ids, want_text = cut_at(llm.tokenizer, plain.token_ids, [stop])
    got = generate(llm, prompt, max_new_tokens=13, stop=[stop])
    assert (got.text, got.token_ids, got.finish_reason) == (want_text, want_ids, "stop")
    assert len(want_text) < len(plain.text)


def test_the_canvas_decoder_cuts_at_a_stop_string_before_eos(monkeypatch):
    llm = engine_llm("model=tiny_diffusion_gemma", "scheduler.max_num_seqs=4", "scheduler.max_scheduled_tokens=64")
    prompt, params = [100, 200, 300], dict(max_new_tokens=16, seed=0)
    full = generate(llm, prompt, **params)
    # One of its tokens as an EOS id: the output ends in the first canvas (8 tokens).
    eos = full.token_ids[6]
    assert eos not in full.token_ids[:6]
    monkeypatch.setattr(llm.engine, "eos_ids", (*llm.engine.eos_ids, eos))
    plain = generate(llm, prompt, **params)
    assert plain.token_ids == full.token_ids[:6] and plain.finish_reason == "stop"
    for stop in ([llm.tokenizer.decode(full.token_ids[3:4])], [llm.tokenizer.decode(full.token_ids[6:7])]):
        got = generate(llm, prompt, **params, stop=stop)
        if stop[0] in plain.text:  # the stop string lies before EOS: it wins
            want_ids, want_text = cut_at(llm.tokenizer, plain.token_ids, stop)
            assert (got.text, got.token_ids, got.finish_reason) == (want_text, want_ids, "stop")
        else:  # it lies past EOS: EOS wins
            assert (got.text, got.token_ids, got.finish_reason) == (plain.text, plain.token_ids, "stop")
    assert llm.engine.kv_free_pages == llm.engine.kv_total_pages


# ------------------------------------------------------------------------------ through HTTP

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from server_helpers import ServerProcess

    proc = ServerProcess(BASE + ["decoding.block_length=16", "server.host=127.0.0.1", "server.port=0",
                                 "server.log_level=warning"], tmp_path_factory.mktemp("serve"))
    yield proc
    proc.stop()


def _chat(server, messages, stream: bool, **body) -> tuple[str, list[int], str, dict]:
    """(text, token ids, finish_reason, usage) of one chat completion, streamed or not."""
    payload = {"model": "arith_llada2", "messages": messages, "return_token_ids": True, **body}
    if not stream:
        r = server.post("/v1/chat/completions", json=payload)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["message"]["content"], choice["token_ids"], choice["finish_reason"], r.json()["usage"]
    payload.update(stream=True, stream_options={"include_usage": True})
    text, ids, finish, usage = "", [], None, None
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=payload, timeout=120) as r:
        lines = [line[len("data: "):] for line in r.iter_lines() if line]
    assert lines[-1] == "[DONE]"
    for chunk in map(json.loads, lines[:-1]):
        if not chunk["choices"]:
            usage = chunk["usage"]
            continue
        choice = chunk["choices"][0]
        text += choice["delta"].get("content") or ""
        ids += choice.get("token_ids") or []
        finish = choice["finish_reason"] or finish
    return text, ids, finish, usage


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_the_server_honours_a_stop_string_before_eos(server, stream):
    text, ids, finish, usage = _chat(server, QUESTION, stream, stop=["answer"])
    assert (text, ids, finish) == ("3 + 4 = 7. The ", ANSWER_IDS[:10], "stop")
    assert usage["completion_tokens"] == len(ids) == 10
    text, ids, finish, usage = _chat(server, SPANNING, stream, stop="is 50.")
    assert (text, ids, finish) == ("72 - 22 = 50. The answer ", SPANNING_IDS[:16], "stop")
    assert usage["completion_tokens"] == len(ids) == 16
    text, ids, finish, usage = _chat(server, QUESTION, stream)  # no stop strings: EOS, nothing changes
    assert (text, ids, finish, usage["completion_tokens"]) == (ANSWER, ANSWER_IDS, "stop", 14)
