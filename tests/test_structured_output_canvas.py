"""Structured output on Diffusion-Gemma's canvas decoder (issue 39 item 2, docs/structured_output.md,
Canvas decoding): the block-aware rule on one canvas step, then every output of mixed batches valid
on the random-weight tiny model in fp32 and bf16 (with preemption and the static path enabled),
unconstrained rows unchanged by constrained ones, an all-token grammar changing no token, and one
served request with response_format."""
import functools
import json

import jsonschema
import pytest
import torch

from fluxlab.engine.constraint import Constraint, Grammar, GrammarVocab
from fluxlab.engine.constraint.schemas import SCHEMAS
from fluxlab.engine.request import SamplingParams
from fluxlab.models.diffusion_gemma.constrained import UNDECIDED, constrained_canvas_step
from fluxlab.models.diffusion_gemma.decoding import CanvasKnobs, CanvasState
from fluxlab.models.diffusion_gemma.request import CanvasRequest

MODEL = "tiny_diffusion_gemma"
KEY_A = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}


@functools.lru_cache(maxsize=None)
def canvas_llm(dtype: str = "float32", *extra: str):
    from fluxlab.llm import LLM

    return LLM(overrides=[f"model={MODEL}", "engine.device=cpu", f"engine.dtype={dtype}", "model.max_model_len=512",
                          *extra])


@pytest.fixture(scope="module")
def llm(one_thread):
    return canvas_llm()


# --- the rule on one canvas step ---
# Knobs whose stop rule holds at every step (stability 0, any entropy is confident): each step is a
# final attempt, so what it proposes is the argmax canvas, which the logits below choose.
ALWAYS_FINAL = CanvasKnobs(max_denoising_steps=8, entropy_bound=0.1, t_min=0.4, t_max=1.0, stability_threshold=0,
                           confidence_threshold=1e9)


def one_row(llm, grammar, output_ids=()):
    engine = llm.engine
    L = engine.block_length
    request = CanvasRequest("unit", [3, 4, 5], SamplingParams(max_new_tokens=4 * L, decoder="canvas"), L,
                            engine.eos_ids, ALWAYS_FINAL)
    request.constraint = Constraint(GrammarVocab.of(engine.tokenizer, engine.eos_ids), grammar)
    request.output_ids.extend(output_ids)
    state = CanvasState(0, torch.device("cpu"))
    state.canvas = state.draw_canvas(engine.model_config.vocab_size, L)
    state.enter_canvas()
    state.needs_canvas = False
    return request, state


def logits_choosing(vocab: int, *choices: list[int]) -> torch.Tensor:
    """[1, L, V] logits whose argmax at position p is choices[0][p], then choices[1][p], ... (ranked)."""
    logits = torch.zeros(1, len(choices[0]), vocab)
    for rank, tokens in enumerate(choices):
        for p, t in enumerate(tokens):
            logits[0, p, t] = 20.0 - rank
    return logits


def test_a_final_canvas_commits_only_a_valid_decided_prefix(llm):
    """An argmax canvas with a token the grammar refuses is not committed: its valid prefix stays
    decided, the refused position and everything right of it go on denoising (unchecked right of
    it); the next step's mask at the first undecided position makes it valid, and the canvas commits."""
    tok, vocab = llm.engine.tokenizer, llm.engine.model_config.vocab_size
    eos = llm.engine.eos_ids[0]
    text = tok.encode('{"a":12}', add_special_tokens=False) + [eos]
    wrong = list(text)
    wrong[2] = tok.encode("b", add_special_tokens=False)[0]  # {"b":12}: only "a" is a key
    assert len(text) == llm.engine.block_length and wrong[2] != text[2]
    request, state = one_row(llm, Grammar.json_schema(KEY_A))

    step = constrained_canvas_step(logits_choosing(vocab, wrong, text), [request], [state], None)
    assert not step.final[0]
    assert state.decided[:2].tolist() == text[:2] and state.decided[2] == UNDECIDED
    assert state.decided[3:].tolist() == wrong[3:]  # right of the undecided one: as proposed, unchecked
    assert step.block[0, :2].tolist() == text[:2] and step.block[0, 3:].tolist() == wrong[3:]
    assert request.constraint.ahead == 0  # the matcher is back at the committed output

    state.canvas = step.block[0]
    step = constrained_canvas_step(logits_choosing(vocab, wrong, text), [request], [state], None)
    assert step.final[0] and step.block[0].tolist() == text  # the mask at position 2 left "a" its best


def test_eos_only_where_the_grammar_may_end(llm):
    tok, vocab = llm.engine.tokenizer, llm.engine.model_config.vocab_size
    eos = llm.engine.eos_ids[0]
    text = tok.encode('{"a":12}', add_special_tokens=False) + [eos]
    early = text[:5] + [eos] * 3  # {"a": then EOS: not a complete object
    request, state = one_row(llm, Grammar.json_schema(KEY_A))
    step = constrained_canvas_step(logits_choosing(vocab, early, text), [request], [state], None)
    assert not step.final[0] and state.decided[:5].tolist() == text[:5] and state.decided[5] == UNDECIDED
    state.canvas = step.block[0]
    step = constrained_canvas_step(logits_choosing(vocab, early, text), [request], [state], None)
    assert not step.final[0] and state.decided[5] == text[5]  # the mask kept EOS out; "12" was next best
    state.canvas = step.block[0]
    step = constrained_canvas_step(logits_choosing(vocab, early, text), [request], [state], None)
    assert step.final[0] and step.block[0].tolist() == text  # EOS after the closing brace stands


def test_a_constrained_canvas_ends_past_its_step_budget(llm):
    """Past max_denoising_steps every step is a final attempt at the last temperature of the schedule."""
    knobs = CanvasKnobs(max_denoising_steps=2, entropy_bound=0.1, t_min=0.4, t_max=1.0, stability_threshold=1,
                        confidence_threshold=0.0)
    assert knobs.temperature(5) == knobs.temperature(1) > knobs.t_min
    out = llm.generate(["x"], SamplingParams(max_new_tokens=64, max_denoising_steps=2, seed=3,
                                             grammar=Grammar.json_schema(SCHEMAS["nested"])))[0]
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), SCHEMAS["nested"])


# --- the engine ---
def schema_batch(max_new_tokens: int = 128):
    """Every schema once (its own seed), an unconstrained request after every fourth."""
    prompts, params, schemas = [], [], []
    for i, (name, schema) in enumerate(SCHEMAS.items()):
        prompts.append(f"Answer in JSON ({name}).")
        params.append(SamplingParams(max_new_tokens=max_new_tokens, seed=i, grammar=Grammar.json_schema(schema)))
        schemas.append(schema)
        if i % 4 == 0:
            prompts.append(f"Tell me something ({i}).")
            params.append(SamplingParams(max_new_tokens=20, seed=100 + i))
            schemas.append(None)
    return prompts, params, schemas


def assert_all_valid(llm, results, schemas):
    eos = set(llm.engine.eos_ids)
    checked = 0
    for result, schema in zip(results, schemas):
        if schema is None:
            continue
        assert result.finish_reason == "stop", (result.finish_reason, result.text)
        assert not eos & set(result.token_ids)  # EOS ended it (where the grammar may end) and is not output
        jsonschema.validate(json.loads(result.text), schema)
        checked += 1
    assert checked == len(SCHEMAS) >= 20


def plain_alone(llm, prompts, params, schemas):
    """The unconstrained requests of a batch, run on their own."""
    free = [i for i, s in enumerate(schemas) if s is None]
    return free, llm.generate([prompts[i] for i in free], [params[i] for i in free])


@pytest.mark.parametrize("dtype, extra", [
    ("float32", ()),
    ("bfloat16", ()),
    # 4 seats and a page budget that preempts: requests join, leave and are recomputed
    ("float32", ("scheduler.max_num_seqs=4", "scheduler.num_device_pages=12", "scheduler.enable_prefix_cache=false")),
])
def test_every_output_of_a_mixed_batch_validates_against_its_schema(one_thread, dtype, extra):
    llm = canvas_llm(dtype, *extra)
    prompts, params, schemas = schema_batch(max_new_tokens=64 if extra else 128)
    results = llm.generate(prompts, params)
    assert_all_valid(llm, results, schemas)
    if extra:
        assert sum(r.stats.preemptions for r in results) > 0
    if dtype == "float32":  # (bf16 on CPU is not batch invariant, with or without a grammar in the batch)
        free, alone = plain_alone(llm, prompts, params, schemas)
        assert [results[i].token_ids for i in free] == [r.token_ids for r in alone]  # constrained rows change none


def test_the_static_path_keeps_unconstrained_batches(one_thread):
    """With the static denoising path on (called as is on CPU), batches with a grammar run eagerly and
    validate, and unconstrained requests give the tokens they give alone."""
    llm = canvas_llm("float32", "scheduler.max_num_seqs=4")
    runner = llm.engine.runner
    runner.enable_denoise_graphs([1, 2, 4], capture=False)
    static_rows = []  # per static step: whether each row holds a grammar
    run = runner.graphs.run
    runner.graphs.run = lambda requests, *a: static_rows.append([r.constraint is not None for r in requests]) or \
        run(requests, *a)
    try:
        prompts, params, schemas = schema_batch(max_new_tokens=96)
        results = llm.generate(prompts, params)
        assert_all_valid(llm, results, schemas)
        assert not any(any(step) for step in static_rows)
        free, alone = plain_alone(llm, prompts, params, schemas)
        assert static_rows and not any(any(step) for step in static_rows)  # the plain batch took the static path
        assert [results[i].token_ids for i in free] == [r.token_ids for r in alone]
    finally:
        runner.release_graphs()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_grammar_that_allows_everything_changes_no_token(one_thread, dtype):
    llm = canvas_llm(dtype)
    vocab = llm.engine.model_config.vocab_size
    assert len(llm.engine.tokenizer) == vocab  # no padded head rows: the mask removes nothing
    anything = Grammar("lark", f"start: <[0-{vocab - 1}]>*")
    prompts = [[{"role": "user", "content": "What is 12+7?"}], "x", [5, 17, 301, 44, 9, 1200, 77, 3, 18, 250, 11]]
    for seed, max_new in ((0, 64), (7, 21)):
        plain = [SamplingParams(max_new_tokens=max_new, seed=seed + i) for i in range(3)]
        held = [SamplingParams(max_new_tokens=max_new, seed=seed + i, grammar=anything) for i in range(3)]
        expected = [r.token_ids for r in llm.generate(prompts, plain)]
        assert [r.token_ids for r in llm.generate(prompts, held)] == expected
        mixed = llm.generate(prompts, [held[0], plain[1], held[2]])
        assert [r.token_ids for r in mixed] == expected


def test_served_response_format_on_a_diffusion_gemma_server(tmp_path):
    from server_helpers import ServerProcess

    schema = SCHEMAS["nested"]
    server = ServerProcess([f"model={MODEL}", "engine.dtype=float32", "engine.device=cpu", "server.host=127.0.0.1",
                            "server.port=0", "server.log_level=warning"], tmp_path)
    try:
        response_format = {"type": "json_schema", "json_schema": {"name": "nested", "schema": schema, "strict": True}}
        chat = server.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a user"}],
                                                         "max_tokens": 96, "seed": 1, "response_format": response_format})
        assert chat.status_code == 200, chat.text
        choice = chat.json()["choices"][0]
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    finally:
        server.stop()
