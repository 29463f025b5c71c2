"""Structured output (issue 39, docs/structured_output.md): the block-aware rule on its own, then every
output of a batch valid against its schema on random and embedded models, and an all-text grammar
giving the unconstrained tokens exactly."""
import json
from types import SimpleNamespace

import jsonschema
import numpy as np
import pytest
import torch

from fluxlab.engine.constraint import Constraint, Grammar, GrammarVocab
from fluxlab.engine.constraint.matcher import Walk
from fluxlab.engine.constraint.rule import BlockGuard
from fluxlab.engine.constraint.schemas import SCHEMAS
from fluxlab.engine.request import InvalidRequest, SamplingParams

M = 10_000  # the mask id of the unit tests (outside the tiny vocabulary, as a real mask id is special)
KEY_A = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok(tiny_ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_ckpt), local_files_only=True)


@pytest.fixture(scope="module")
def vocab(tok):
    return GrammarVocab.of(tok, (tok.eos_token_id,))


def ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def guard_of(vocab, grammar, block, output_ids=(), lo=0):
    """A BlockGuard over one row: a request whose active block is `block` (M = undecided)."""
    constraint = Constraint(vocab, grammar)
    request = SimpleNamespace(constraint=constraint, output_ids=list(output_ids), active_block=0,
                              num_prompt_tokens=lo, prompt_positions_in_active_block=lambda: lo,
                              params=SimpleNamespace(max_new_tokens=len(block) - lo, decoder="threshold", temperature=0))
    return BlockGuard([request], np.array([0]), np.array([block]), M), constraint


def test_the_first_undecided_position_gets_the_grammar_mask(tok, vocab):
    brace, quote = ids(tok, "{")[0], ids(tok, '"')[0]
    guard, _ = guard_of(vocab, Grammar.json_schema(KEY_A), [brace, M, M, M])
    assert guard.rows[0].fixed == 1 and guard.rows[0].first_undecided == 1
    logits = torch.zeros(1, 4, vocab.size)
    guard.mask_logits(logits, np.array([0]))
    assert torch.isfinite(logits[0, 1]).nonzero().flatten().tolist() == [quote]
    assert torch.isfinite(logits[0, [0, 2, 3]]).all()  # other positions untouched
    guard.close()


def test_a_refused_token_becomes_undecided_and_positions_right_of_it_wait(tok, vocab):
    brace, quote, colon, x = ids(tok, "{")[0], ids(tok, '"')[0], ids(tok, ":")[0], ids(tok, "x")[0]
    guard, constraint = guard_of(vocab, Grammar.json_schema(KEY_A), [brace, M, M, M, M])
    kept, no_masks = guard.repair(np.array([[brace, quote, x, M, colon]]))
    assert kept[0].tolist() == [brace, quote, M, M, colon] and not no_masks[0]  # "x" is no key; ":" unchecked
    assert constraint.ahead == 0 and constraint.committed == 0


def test_tokens_right_of_an_undecided_position_are_not_checked(tok, vocab):
    brace, x = ids(tok, "{")[0], ids(tok, "x")[0]
    guard, _ = guard_of(vocab, Grammar.json_schema(KEY_A), [brace, M, M])
    kept, _ = guard.repair(np.array([[brace, M, x]]))
    assert kept[0].tolist() == [brace, M, x]


def test_an_edit_that_breaks_the_decided_prefix_is_undone(tok, vocab):
    block = ids(tok, '{"a"') + [M, M]
    bad = ids(tok, '{"b"')
    assert len(bad) == 4
    guard, _ = guard_of(vocab, Grammar.json_schema(KEY_A), block)
    colon = ids(tok, ":")[0]
    kept, _ = guard.repair(np.array([bad + [colon, M]]))
    assert kept[0].tolist() == block[:4] + [colon, M]


def test_an_edit_that_keeps_the_prefix_valid_stands(tok, vocab):
    a, b, c = (ids(tok, ch)[0] for ch in "abc")
    guard, _ = guard_of(vocab, Grammar("regex", "[a-z]+"), [a, b, M])
    kept, _ = guard.repair(np.array([[c, b, a]]))
    assert kept[0].tolist() == [c, b, a]


def test_eos_only_where_the_grammar_may_end(tok, vocab):
    eos = tok.eos_token_id
    body = ids(tok, '{"a":12')
    guard, _ = guard_of(vocab, Grammar.json_schema(KEY_A), body + [M, M])
    kept, _ = guard.repair(np.array([body + [eos, M]]))
    assert kept[0, len(body)] == M  # the object is open: no EOS
    done = ids(tok, '{"a":12}')
    guard, _ = guard_of(vocab, Grammar.json_schema(KEY_A), done + [M, M])
    assert guard.rows[0].first_undecided == len(done)
    logits = torch.zeros(1, len(done) + 2, vocab.size)
    guard.mask_logits(logits, np.array([0]))
    assert torch.isfinite(logits[0, len(done)]).nonzero().flatten().tolist() == [eos]  # only EOS may follow
    x = ids(tok, "x")[0]
    kept, no_masks = guard.repair(np.array([done + [eos, x]]))
    assert kept[0].tolist() == done + [eos, x] and no_masks[0]  # after EOS nothing is output or checked


def test_the_matcher_stands_at_the_committed_output_between_steps(tok, vocab):
    committed = ids(tok, '{"a"')
    guard, constraint = guard_of(vocab, Grammar.json_schema(KEY_A), ids(tok, ":1") + [M], output_ids=committed)
    assert constraint.committed == len(committed) and constraint.ahead == 2
    guard.repair(np.array([ids(tok, ":1") + ids(tok, "}")]))
    assert constraint.ahead == 0 and constraint.committed == len(committed)
    assert constraint.walk(np.array(ids(tok, ":1}")), 0, 3, M) == (3, Walk.END)
    constraint.sync(committed)  # a walk left ahead (a step that raised) is undone by the next sync
    assert constraint.ahead == 0


@pytest.mark.parametrize("grammar, message", [
    (Grammar.json_schema({"type": "nonsense"}), "Invalid type"),
    (Grammar("json_schema", "{"), "invalid json_schema"),
    (Grammar("json_schema", "[1]"), "must be a JSON object"),
    (Grammar("regex", "[a-"), "unclosed character class"),
    (Grammar("lark", "start: foo"), "unknown name"),
    (Grammar("xml", "<a/>"), "unknown grammar kind"),
])
def test_bad_grammars_are_refused_naming_the_field(grammar, message):
    decoding = {"decoder": "threshold", "block_length": 32, "threshold": 0.9, "steps": 32, "editing_threshold": 0.5,
                "max_post_steps": 4, "max_steps_per_block": 100, "low_threshold": 0.5, "temperature": 0.0,
                "top_p": 1.0, "top_k": 0, "max_denoising_steps": None, "entropy_bound": None, "t_min": None,
                "t_max": None, "stability_threshold": None, "confidence_threshold": None}
    with pytest.raises(InvalidRequest, match=message) as err:
        SamplingParams(grammar=grammar).resolve(decoding, 16)
    assert err.value.param == "grammar"
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(grammar=Grammar("json_object"), ignore_eos=True).resolve(decoding, 16)
    assert err.value.param == "ignore_eos"


# --- the engine ---
BLOCK_DECODERS = ("threshold", "hierarchy", "joint_threshold")


def make_llm(model, dtype, *extra):
    from fluxlab.llm import LLM

    return LLM(overrides=[f"model={model}", "engine.device=cpu", f"engine.dtype={dtype}",
                          "model.max_model_len=512", *extra])


def schema_batch(decoders, max_new_tokens=128):
    """Every schema once, decoders in turn, every third request sampled, and unconstrained rows between."""
    prompts, params, schemas = [], [], []
    for i, (name, schema) in enumerate(SCHEMAS.items()):
        prompts.append(f"Answer in JSON ({name}).")
        sampled = dict(temperature=0.8, seed=i) if i % 3 == 2 and decoders[0] != "levenshtein_joint" else {}
        params.append(SamplingParams(max_new_tokens=max_new_tokens, decoder=decoders[i % len(decoders)],
                                     grammar=Grammar.json_schema(schema), **sampled))
        schemas.append(schema)
        if i % 5 == 0:
            prompts.append("Tell me something.")
            params.append(SamplingParams(max_new_tokens=48, decoder=decoders[i % len(decoders)]))
            schemas.append(None)
    return prompts, params, schemas


def assert_all_valid(results, schemas):
    checked = 0
    for result, schema in zip(results, schemas):
        if schema is None:
            continue
        assert result.finish_reason == "stop", (result.finish_reason, result.text)
        jsonschema.validate(json.loads(result.text), schema)
        checked += 1
    assert checked >= 20


@pytest.mark.parametrize("model, dtype, decoders", [
    ("tiny_llada2", "float32", BLOCK_DECODERS),
    ("tiny_llada2", "bfloat16", BLOCK_DECODERS),
    ("arith_llada2", "float32", BLOCK_DECODERS),
    # bf16 on a CPU without bf16 instructions is ~40x slower; tiny_llada2 covers the dtype in the default run
    pytest.param("arith_llada2", "bfloat16", BLOCK_DECODERS, marks=pytest.mark.slow),
    ("tiny_llada22", "float32", ("levenshtein_joint",)),
])
def test_every_output_of_a_mixed_batch_validates_against_its_schema(one_thread, model, dtype, decoders):
    llm = make_llm(model, dtype)
    try:
        prompts, params, schemas = schema_batch(decoders)
        assert_all_valid(llm.generate(prompts, params), schemas)
    finally:
        llm.shutdown()


def test_a_constrained_request_alone_equals_itself_in_a_batch(one_thread):
    llm = make_llm("tiny_llada2", "float32", "scheduler.max_num_seqs=4")
    try:
        prompts, params, _ = schema_batch(BLOCK_DECODERS, max_new_tokens=96)
        batched = llm.generate(prompts[:9], params[:9])  # more requests than seats: they join and leave
        for i in (0, 3, 7):
            assert llm.generate([prompts[i]], [params[i]])[0].token_ids == batched[i].token_ids
    finally:
        llm.shutdown()


def every_token_but_the_mask(llm) -> Grammar:
    """A grammar over token ids (llguidance Lark's <[a-b]> ranges) that takes every id but the mask, any
    number of times: the constraint of a run that constrains nothing."""
    mask, vocab = llm.engine.mask_id, llm.engine.model_config.vocab_size
    return Grammar("lark", f"start: <[0-{mask - 1},{mask + 1}-{vocab - 1}]>*")


@pytest.mark.parametrize("model, decoders", [("arith_llada2", BLOCK_DECODERS), ("tiny_llada2", BLOCK_DECODERS),
                                             ("tiny_llada22", ("levenshtein_joint",))])
def test_a_grammar_that_allows_everything_changes_no_token(one_thread, model, decoders):
    llm = make_llm(model, "float32")
    try:
        prompts = [[{"role": "user", "content": "What is 12+7?"}], [{"role": "user", "content": "Tom has 3 apples."}],
                   "x"]
        grammar = every_token_but_the_mask(llm)
        for decoder in decoders:
            plain = llm.generate(prompts, SamplingParams(max_new_tokens=64, decoder=decoder))
            anything = llm.generate(prompts, SamplingParams(max_new_tokens=64, decoder=decoder, grammar=grammar))
            assert [r.token_ids for r in anything] == [r.token_ids for r in plain]
            if decoder != "levenshtein_joint":  # sampled rows too: the same draws from the same distributions
                seeded = SamplingParams(max_new_tokens=64, decoder=decoder, temperature=0.9, seed=5)
                plain = llm.generate(prompts, seeded)
                seeded.grammar = grammar
                anything = llm.generate(prompts, seeded)
                assert [r.token_ids for r in anything] == [r.token_ids for r in plain]
    finally:
        llm.shutdown()


def test_the_json_schema_workload_scores_validity():
    from fluxlab.bench.scoring import json_schema_valid
    from fluxlab.bench.workload import json_schema_prompts

    prompts = json_schema_prompts(46, 64, constrained=True)
    assert len({p.metadata["schema"] for p in prompts}) == len(SCHEMAS) >= 20
    assert all(p.response_format["type"] == "json_schema" for p in prompts)
    assert all(p.response_format is None for p in json_schema_prompts(3, 64, constrained=False))
    flat = json.dumps(SCHEMAS["flat"])
    assert json_schema_valid('{"name":"Ann","age":3}', flat)
    assert not json_schema_valid('{"name":"Ann","age":300}', flat) and not json_schema_valid('{"name":', flat)


def test_response_format_maps_to_a_grammar():
    from fluxlab.engine.constraint import grammar_of_response_format

    assert grammar_of_response_format({"type": "text"}) is None
    assert grammar_of_response_format({"type": "json_object"}) == Grammar("json_object")
    schema = {"type": "object"}
    assert grammar_of_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                                             "strict": True}}).kind == "json_schema"
    assert grammar_of_response_format({"type": "regex", "regex": "[0-9]+"}) == Grammar("regex", "[0-9]+")
    assert grammar_of_response_format({"type": "grammar", "grammar": "start: /a+/"}).kind == "lark"
    for bad in ({"type": "xml"}, {"type": "json_schema"}, {"type": "regex"}, [], {"type": 3}):
        with pytest.raises(ValueError):
            grammar_of_response_format(bad)


def test_the_server_bodies_take_response_format():
    from pydantic import ValidationError

    from fluxlab.server.protocol import ChatCompletionRequest, CompletionRequest

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}})
    assert chat.sampling_params(16).grammar == Grammar.json_schema(schema)
    done = CompletionRequest.model_validate({"prompt": "hi", "response_format": {"type": "json_object"}})
    assert done.sampling_params(16).grammar == Grammar("json_object")
    assert CompletionRequest.model_validate({"prompt": "hi"}).sampling_params(16).grammar is None
    for bad, message in (({"type": "xml"}, "not supported"), ({"type": "regex", "regex": "[a-"}, "unclosed"),
                         ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "nonsense"}}},
                          "Invalid type")):
        with pytest.raises(ValidationError, match=message) as err:
            CompletionRequest.model_validate({"prompt": "hi", "response_format": bad})
        assert err.value.errors()[0]["loc"][0] == "response_format"


def test_served_chat_and_completions_answer_in_their_schema(tmp_path):
    """A served tiny model, non-streaming and streaming, chat and completions: the text validates."""
    from server_helpers import TINY, ServerProcess

    schema = SCHEMAS["nested"]
    response_format = {"type": "json_schema", "json_schema": {"name": "nested", "schema": schema, "strict": True}}
    server = ServerProcess(TINY, tmp_path)
    try:
        chat = server.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a user"}],
                                                         "max_tokens": 96, "response_format": response_format})
        assert chat.status_code == 200, chat.text
        jsonschema.validate(json.loads(chat.json()["choices"][0]["message"]["content"]), schema)
        done = server.post("/v1/completions", json={"prompt": "x", "max_tokens": 96,
                                                    "response_format": {"type": "json_object"}})
        assert isinstance(json.loads(done.json()["choices"][0]["text"]), dict)
        streamed = server.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "b"}],
                                                             "stream": True, "max_tokens": 96,
                                                             "response_format": response_format})
        chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
        pieces = [c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]]
        jsonschema.validate(json.loads("".join(pieces)), schema)
    finally:
        server.stop()


def test_a_request_gets_its_matcher_before_it_is_registered(one_thread, monkeypatch):
    import fluxlab.engine.constraint as constraint

    llm = make_llm("tiny_llada2", "float32")
    try:
        engine = llm.engine
        request_id = engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=8, grammar=Grammar("json_object")))
        assert engine.requests[request_id].constraint is not None
        engine.abort_request(request_id)

        def refuse(vocab, grammar):
            raise ValueError("invalid json_object: this tokenizer cannot")

        monkeypatch.setattr(constraint, "Constraint", refuse)
        with pytest.raises(InvalidRequest, match="this tokenizer cannot") as err:
            engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=8, grammar=Grammar("json_object")))
        assert err.value.param == "grammar" and request_id not in engine.requests and len(engine.requests) == 0
    finally:
        llm.shutdown()
