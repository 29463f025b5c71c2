"""Tool calls (issue 39 item 5, docs/structured_output.md "Tools"): the grammar of each tool_choice, the
reply read back as OpenAI's tool_calls (whole and streamed), tools in the chat prompt, the 400s, every
generated call valid against its tool's schema in a mixed batch, and the openai SDK against a served
tiny model."""
from __future__ import annotations

import copy
import json

import jsonschema
import pytest

from fluxlab.engine.chat import render_chat
from fluxlab.engine.constraint import Constraint, Grammar, GrammarVocab
from fluxlab.engine.constraint.tools import ToolSpec, parse_reply, tool_call_grammar
from fluxlab.engine.loading import load_tokenizer
from fluxlab.server.tool_calls import ToolCallStream, reply_message

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"$ref": "#/$defs/small"}, "b": {"$ref": "#/$defs/small"}},
       "required": ["a", "b"], "additionalProperties": False,
       "$defs": {"small": {"type": "integer", "minimum": 0, "maximum": 99}}}
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
SPECS = [ToolSpec.of(name, schema) for name, schema in SCHEMAS.items()]
OPENAI_TOOLS = [{"type": "function", "function": {"name": n, "description": f"the {n} tool", "parameters": s}}
                for n, s in SCHEMAS.items()]

CALL_W = '<tool_call>{"name":"get_weather","arguments":{"city":"Oslo"}}</tool_call>'
CALL_A = '<tool_call>{"name":"add","arguments":{"a":2,"b":3}}</tool_call>'


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def vocab(tok):
    return GrammarVocab.of(tok, (tok.eos_token_id,))


def matches(vocab, tok, grammar: Grammar, text: str) -> bool:
    """The grammar takes the whole of `text` and may end after it."""
    constraint = Constraint(vocab, grammar)
    ids = tok.encode(text, add_special_tokens=False)
    return constraint.matcher.try_consume_tokens(ids) == len(ids) and constraint.matcher.is_accepting()


# --- the grammar of each tool_choice ---
@pytest.mark.parametrize("choice, parallel, good, bad", [
    ("auto", True, ["Sunny today.", "", "<tool", CALL_W, CALL_W + CALL_A],
     ["<tool_call>Sunny", CALL_W + " and more", '<tool_call>{"name":"nope","arguments":{}}</tool_call>']),
    ("auto", False, ["Sunny.", CALL_A], [CALL_W + CALL_A]),
    ("required", True, [CALL_W, CALL_A + CALL_W + CALL_A], ["Sunny.", "", CALL_W + "x"]),
    ("required", False, [CALL_A], [CALL_A + CALL_W, "Sunny."]),
    ("add", True, [CALL_A], [CALL_W, CALL_A + CALL_A, "Sunny."]),
])
def test_each_tool_choice_has_its_grammar(tok, vocab, choice, parallel, good, bad):
    grammar = tool_call_grammar(SPECS, choice, parallel)
    assert grammar.problem() is None
    for text in good:
        assert matches(vocab, tok, grammar, text), text
    for text in bad:
        assert not matches(vocab, tok, grammar, text), text


def test_arguments_must_match_the_tool_schema(tok, vocab):
    grammar = tool_call_grammar(SPECS, "required")
    for args in ('{"a":2}', '{"a":2,"b":300}', '{"a":2,"b":3,"c":1}', '{"a": 2,"b":3}', '{"b":3,"a":2}'):
        assert not matches(vocab, tok, grammar, f'<tool_call>{{"name":"add","arguments":{args}}}</tool_call>'), args
    assert not matches(vocab, tok, grammar, '<tool_call>{"name":"get_weather","arguments":{"city":"x","unit":"k"}}'
                                            '</tool_call>')


def test_auto_takes_a_json_response_format_as_its_text_branch(tok, vocab):
    grammar = tool_call_grammar(SPECS, "auto", text=Grammar.json_schema({"type": "object", "properties": {
        "answer": {"type": "integer"}}, "required": ["answer"], "additionalProperties": False}))
    assert matches(vocab, tok, grammar, '{"answer":4}') and matches(vocab, tok, grammar, CALL_A)
    assert not matches(vocab, tok, grammar, "four")
    with pytest.raises(ValueError, match="regex response_format cannot be combined with tools"):
        tool_call_grammar(SPECS, "auto", text=Grammar("regex", "[0-9]+"))
    with pytest.raises(ValueError, match="not among the tools"):
        tool_call_grammar(SPECS, "nope")


# --- reading the reply back ---
def test_a_reply_of_calls_becomes_tool_calls():
    message, calls = reply_message(CALL_W + CALL_A, calls_only=False)
    assert calls and message["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "Oslo"}), ("add", {"a": 2, "b": 3})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in message["tool_calls"])
    assert reply_message("Sunny.", calls_only=False) == ({"role": "assistant", "content": "Sunny."}, False)
    assert reply_message("<tool", calls_only=False)[0]["content"] == "<tool"  # finished: a prefix of the marker is text
    cut, _ = reply_message(CALL_W + '<tool_call>{"name":"add","arguments":{"a":', calls_only=True)
    assert [c["function"]["arguments"] for c in cut["tool_calls"]] == ['{"city":"Oslo"}', '{"a":']  # max_tokens


def test_strings_holding_braces_and_the_marker_do_not_end_the_arguments():
    text = '<tool_call>{"name":"get_weather","arguments":{"city":"}</tool_call>\\"{"}}</tool_call>'
    (call,) = parse_reply(text).calls
    assert call.complete and json.loads(call.arguments) == {"city": '}</tool_call>"{'}


@pytest.mark.parametrize("step", [1, 3, 7, 16])
def test_streamed_pieces_add_up_to_the_whole_reply(step):
    text = CALL_W + CALL_A
    stream = ToolCallStream(calls_only=False)
    deltas = [stream.delta(text[i:i + step], i + step >= len(text)) for i in range(0, len(text), step)]
    deltas = [d for d in deltas if d]
    names, arguments = {}, {}
    for delta in deltas:
        assert "content" not in delta
        for piece in delta["tool_calls"]:
            if "id" in piece:  # the first delta of a call: its index, id, type and whole name
                assert piece["type"] == "function" and piece["index"] not in names
                names[piece["index"]] = piece["function"]["name"]
            arguments[piece["index"]] = arguments.get(piece["index"], "") + piece["function"]["arguments"]
    assert names == {0: "get_weather", 1: "add"}
    assert [json.loads(arguments[i]) for i in (0, 1)] == [{"city": "Oslo"}, {"a": 2, "b": 3}]
    assert stream.made_calls


def test_a_streamed_text_reply_waits_only_while_it_may_be_a_call():
    stream = ToolCallStream(calls_only=False)
    assert stream.delta("<to", False) is None  # a prefix of <tool_call>: text or calls
    assert stream.delta("day", False) == {"content": "<today"}
    assert stream.delta(" is", True) == {"content": " is"}
    assert not stream.made_calls


# --- tools in the prompt ---
HISTORY = [{"role": "user", "content": "Weather in Oslo?"},
           {"role": "assistant", "content": "", "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "12 degrees"}]


def test_a_template_without_tools_gets_the_text_form(tok):
    text = render_chat(tok, HISTORY, OPENAI_TOOLS)
    assert text.startswith("<role>SYSTEM</role>You may call the functions below.")
    assert '{"name": "add", "description": "the add tool", "parameters": ' in text
    assert '<role>ASSISTANT</role><tool_call>{"name":"get_weather","arguments":{"city":"Oslo"}}</tool_call>' in text
    assert "<role>HUMAN</role><tool_response>12 degrees</tool_response><|role_end|><role>ASSISTANT</role>" in text
    assert render_chat(None, HISTORY).count("<role>OBSERVATION</role><tool_response>12 degrees") == 1  # Ling form


def test_a_template_that_shows_tools_renders_them_itself(tok):
    native = copy.deepcopy(tok)
    native.chat_template = (
        "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% for c in m.tool_calls or [] %}"
        "[call {{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}{% endfor %}<assistant>")
    assert render_chat(native, HISTORY, OPENAI_TOOLS) == (
        '<tools>get_weather;add;</tools><user>Weather in Oslo?<assistant>[call get_weather {"city": "Oslo"}]'
        "<tool>12 degrees<assistant>")


# --- the request bodies ---
def chat_body(**fields):
    return {"messages": [{"role": "user", "content": "hi"}], **fields}


@pytest.mark.parametrize("fields, param, words", [
    ({"tools": OPENAI_TOOLS + OPENAI_TOOLS[:1]}, "tools", "appears twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "nonsense"}}}}}]}, "tools", "tools[0].function.parameters (f)"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools",
     "must describe an object"),
    ({"tools": [{"type": "function", "function": {"name": "two words"}}]}, "tools", "pattern"),
    ({"tools": OPENAI_TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'nope', which is not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": OPENAI_TOOLS, "tool_choice": "sometimes"}, "tool_choice", ""),
    ({"tools": OPENAI_TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", ""),
])
def test_bad_tools_are_refused_naming_the_field(fields, param, words):
    from pydantic import ValidationError

    from fluxlab.server.protocol import ChatCompletionRequest

    with pytest.raises(ValidationError) as err:
        ChatCompletionRequest.model_validate(chat_body(**fields))
    first = err.value.errors()[0]
    assert first["loc"][0] == param and words in first["msg"], first


def test_the_body_gives_the_grammar_of_its_tool_choice():
    from fluxlab.server.protocol import ChatCompletionRequest

    def body(**fields):
        return ChatCompletionRequest.model_validate(chat_body(tools=OPENAI_TOOLS, **fields))

    assert body().grammar == tool_call_grammar(SPECS, "auto", True)
    assert body(tool_choice="required", parallel_tool_calls=False).grammar == tool_call_grammar(SPECS, "required",
                                                                                                False)
    named = {"type": "function", "function": {"name": "add"}}
    assert body(tool_choice=named).grammar == tool_call_grammar(SPECS, "add")
    assert body(tool_choice="none").grammar is None and not body(tool_choice="none").calls_tools
    regex = {"type": "regex", "regex": "[0-9]+"}
    assert body(tool_choice="none", response_format=regex).grammar == Grammar("regex", "[0-9]+")
    assert body(response_format=regex).tool_problem()[0] == "response_format"


# --- the engine: every call valid, in a mixed batch ---
CHOICES = [("auto", True), ("required", True), ("required", False), ("add", True), ("get_weather", False),
           ("auto", False)]


def assert_calls_valid(text, finish_reason, calls_only):
    message, made_calls = reply_message(text, calls_only)
    if not made_calls:
        assert not calls_only and not text.startswith("<tool_call>")
        return 0
    calls = message["tool_calls"]
    complete = calls if finish_reason == "stop" else calls[:-1]  # a reply cut by max_tokens cuts its last call
    for call in complete:
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    return len(complete)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_generated_call_validates_in_a_mixed_batch(one_thread, dtype):
    from fluxlab.engine.request import SamplingParams
    from fluxlab.llm import LLM

    llm = LLM(overrides=["model=tiny_llada2", "engine.device=cpu", f"engine.dtype={dtype}", "model.max_model_len=512",
                         "decoding.block_length=16"])
    try:
        prompts, params, modes = [], [], []
        for i, (choice, parallel) in enumerate(CHOICES):
            decoder = ("threshold", "hierarchy", "joint_threshold")[i % 3]
            sampled = dict(temperature=0.8, seed=i) if i % 2 else {}
            prompts.append(f"Call a tool ({choice}).")
            params.append(SamplingParams(max_new_tokens=160, decoder=decoder,
                                         grammar=tool_call_grammar(SPECS, choice, parallel), **sampled))
            modes.append(choice != "auto")
            prompts.append("Tell me something.")  # an unconstrained row between
            params.append(SamplingParams(max_new_tokens=32, decoder=decoder))
            modes.append(None)
        results = llm.generate(prompts, params)
        valid = 0
        for result, calls_only, (choice, parallel) in zip(results[::2], modes[::2], CHOICES):
            valid += assert_calls_valid(result.text, result.finish_reason, calls_only)
            message, made = reply_message(result.text, calls_only)
            if made and not parallel and result.finish_reason == "stop":
                assert len(message["tool_calls"]) == 1
            if made and choice not in ("auto", "required"):
                assert {c["function"]["name"] for c in message["tool_calls"]} == {choice}
        assert valid >= 4
    finally:
        llm.shutdown()


# --- the openai SDK against a served tiny model ---
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from server_helpers import TINY, ServerProcess

    # the text form's tool listing alone is ~450 tiny-tokenizer tokens
    overrides = [o for o in TINY if not o.startswith("model.max_model_len=")] + ["model.max_model_len=1024"]
    proc = ServerProcess(overrides, tmp_path_factory.mktemp("tools"))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def ask(client, **fields):
    return client.chat.completions.create(model="tiny_llada2", messages=[{"role": "user", "content": "Add 2 and 3."}],
                                          tools=OPENAI_TOOLS, max_tokens=160, **fields)


@pytest.mark.parametrize("tool_choice, parallel", [("required", False), ({"type": "function", "function": {
    "name": "get_weather"}}, True), ("required", True)])
def test_the_openai_sdk_parses_tool_calls(client, tool_choice, parallel):
    reply = ask(client, tool_choice=tool_choice, parallel_tool_calls=parallel)
    choice = reply.choices[0]
    assert choice.message.content is None and choice.message.tool_calls
    assert choice.finish_reason in ("tool_calls", "length")
    calls = choice.message.tool_calls if choice.finish_reason == "tool_calls" else choice.message.tool_calls[:-1]
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    if isinstance(tool_choice, dict):
        assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    if not parallel:
        assert len(choice.message.tool_calls) == 1 and choice.finish_reason == "tool_calls"


def test_the_openai_sdk_parses_streamed_tool_calls(client):
    stream = ask(client, tool_choice="required", parallel_tool_calls=False, stream=True)
    names, arguments, ids, finish = {}, {}, {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for piece in delta.tool_calls or ():
            if piece.id:
                ids[piece.index] = piece.id
                names[piece.index] = piece.function.name
            arguments[piece.index] = arguments.get(piece.index, "") + (piece.function.arguments or "")
        assert not delta.content
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and list(names) == [0] and ids[0].startswith("call_")
    jsonschema.validate(json.loads(arguments[0]), SCHEMAS[names[0]])
    # the same request not streamed: the same call (greedy), another id
    whole = ask(client, tool_choice="required", parallel_tool_calls=False).choices[0].message.tool_calls[0]
    assert (whole.function.name, whole.function.arguments) == (names[0], arguments[0])


def test_auto_answers_in_text_or_calls_and_takes_tool_history(client):
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city":"Oslo"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "12 degrees"}]
    for stream in (False, True):
        reply = client.chat.completions.create(model="tiny_llada2", messages=history, tools=OPENAI_TOOLS,
                                               max_tokens=64, stream=stream)
        if stream:
            chunks = [c for c in reply if c.choices]
            finish = chunks[-1].choices[0].finish_reason
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            made = any(c.choices[0].delta.tool_calls for c in chunks)
        else:
            finish, text = reply.choices[0].finish_reason, reply.choices[0].message.content or ""
            made = bool(reply.choices[0].message.tool_calls)
        assert finish in ("stop", "length", "tool_calls")
        assert made == (finish == "tool_calls" or (finish == "length" and not text))
        assert not text.startswith("<tool_call>")


def test_bad_tools_are_a_400_in_the_openai_shape(client, server):
    import openai

    bad = [({"tools": OPENAI_TOOLS + OPENAI_TOOLS[:1]}, "tools"),
           ({"tools": OPENAI_TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
           ({"tools": OPENAI_TOOLS, "response_format": {"type": "regex", "regex": "[0-9]+"}}, "response_format")]
    for fields, param in bad:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="tiny_llada2", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=8, **fields)
        assert err.value.status_code == 400 and err.value.body["param"] == param, err.value.body
    none = server.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                                                     "tools": OPENAI_TOOLS, "tool_choice": "none"})
    assert none.status_code == 200 and "tool_calls" not in none.json()["choices"][0]["message"]
