"""The OpenAPI document tells the truth: schemathesis fuzzes the live server against it with its
default checks, on a LLaDA2 server and on a Diffusion-Gemma one, each of whose documents lists only
the fields its model accepts.

Bounded: 20 examples per operation and phase (600-800 requests each), a small context so each
generation is short; on 2 CPU cores a run takes 20-40 s.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from fluxlab.models.diffusion_gemma.decoding import CANVAS_KNOBS
from server_helpers import TINY, ServerProcess

GEMMA = ["model=tiny_diffusion_gemma", "engine.dtype=float32", "engine.device=cpu", "model.max_model_len=64",
         "model.max_new_tokens=8", "decoding.max_denoising_steps=4", "server.host=127.0.0.1", "server.port=0",
         "server.log_level=warning"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess(TINY + ["model.max_model_len=64", "model.max_new_tokens=16"],
                         tmp_path_factory.mktemp("openapi"))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def gemma_server(tmp_path_factory):
    proc = ServerProcess(GEMMA, tmp_path_factory.mktemp("openapi_gemma"))
    yield proc
    proc.stop()


def request_fields(server) -> dict:
    return server.get("/openapi.json").json()["components"]["schemas"]["CompletionRequest"]["properties"]


def test_the_document_says_400_and_the_real_content_types(server):
    doc = server.get("/openapi.json").json()
    for path, item in doc["paths"].items():
        for method, operation in item.items():
            assert "422" not in operation["responses"], (method, path)
    completions = doc["paths"]["/v1/completions"]["post"]["responses"]
    assert set(completions["200"]["content"]) == {"application/json", "text/event-stream"}
    assert completions["400"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    schemas = doc["components"]["schemas"]
    assert "HTTPValidationError" not in schemas
    assert schemas["ChatCompletionRequest"]["properties"]["messages"]["minItems"] == 1
    temperature = schemas["CompletionRequest"]["properties"]["temperature"]["anyOf"][0]
    temperature.pop("description", None)
    assert temperature == {"type": "number", "minimum": 0}  # standard keywords, not pydantic's ge
    # every decoding knob's range is the registry's (fluxlab/engine/decoding/knobs.py)
    top_p = schemas["CompletionRequest"]["properties"]["top_p"]["anyOf"][0]
    assert top_p["exclusiveMinimum"] == 0 and top_p["maximum"] == 1
    assert not {"ge", "le", "gt", "lt"} & all_keys(doc)  # pydantic's names never leak into the document


def all_keys(node) -> set:
    if isinstance(node, dict):
        return set(node).union(*(all_keys(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(all_keys(v) for v in node))
    return set()


def test_a_llada_document_offers_only_llada_fields(server):
    fields = request_fields(server)
    for knob in CANVAS_KNOBS:  # listed as null only: a body may carry any name, this one is refused
        assert fields[knob]["type"] == "null", fields[knob]
    # tiny_llada2 has no delete/split ids, so levenshtein_joint (LLaDA2.2) is not offered; canvas is Gemma's
    assert fields["decoder"]["anyOf"][0]["enum"] == ["threshold", "hierarchy", "joint_threshold"]
    assert fields["steps"]["anyOf"][0]["maximum"] == 16  # decoding.block_length
    assert fields["seed"]["anyOf"][0] == {"type": "integer", "format": "int64"}


def test_a_diffusion_gemma_document_offers_only_its_own_fields(gemma_server):
    fields = request_fields(gemma_server)
    assert all(fields[knob]["anyOf"][0]["type"] in ("integer", "number") for knob in CANVAS_KNOBS)
    for knob in ("threshold", "steps", "low_threshold", "editing_threshold", "max_post_steps"):
        assert fields[knob]["type"] == "null", fields[knob]
    assert fields["decoder"]["anyOf"][0]["const"] == "canvas"
    temperature = fields["temperature"]["anyOf"][0]
    assert temperature["minimum"] == temperature["maximum"] == 0  # its own schedule: only 0


@pytest.mark.parametrize("family,body,param", [("llada", {"entropy_bound": 0.1}, "entropy_bound"),
                                               ("llada", {"t_min": 0.2}, "t_min"),
                                               ("gemma", {"threshold": 0.5}, "threshold"),
                                               ("gemma", {"steps": 4}, "steps")])
def test_another_familys_knob_is_a_400_naming_it(request, family, body, param):
    server = request.getfixturevalue("server" if family == "llada" else "gemma_server")
    response = server.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert server.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, param: None}).status_code == 200


def test_a_json_integer_may_be_written_with_a_zero_fraction(server):
    # JSON Schema's integer: 4.0 is 4 (the document says "integer"); 4.5 and "4" are not
    body = {"prompt": [5.0, 17], "max_tokens": 4.0, "seed": 1.0, "n": 1.0}
    assert server.post("/v1/completions", json=body).status_code == 200
    for bad in ({"max_tokens": 4.5}, {"max_tokens": "4"}, {"n": True}):
        assert server.post("/v1/completions", json={"prompt": "hi", **bad}).status_code == 400


def test_a_wrong_method_is_405_with_allow(server):
    response = server.get("/v1/completions")
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
    assert response.json()["error"]["code"] == "method_not_allowed"


def test_the_hook_drops_only_the_rules_a_schema_cannot_state():
    from types import SimpleNamespace

    from fluxlab.server.schemathesis_hooks import filter_failure

    def kept(code: str, status: int, param: str, message: str) -> bool:
        response = SimpleNamespace(status_code=status, json=lambda: {"error": {"param": param, "message": message}})
        return filter_failure(None, SimpleNamespace(code=code), None, response)

    context = "prompt (3 tokens) + max_tokens (4000) exceeds max_model_len=2048"
    assert not kept("ST202", 400, "max_tokens", context)
    assert not kept("ST202", 400, "t_max", "t_max=0.1 must be > t_min=0.4 (transformers' rule)")
    assert kept("ST202", 400, "entropy_bound", "entropy_bound is a canvas-decoder knob")  # a real finding
    assert kept("ST202", 400, "max_tokens", "the request needs 9 KV pages; the cache holds 8")
    assert kept("ST101", 500, "max_tokens", context)  # any other check stays
    assert not kept("ST202", 400, "tool_choice", "tool_choice needs tools")
    assert not kept("ST202", 400, "tools", "tools[0].function.parameters (f): invalid json_schema: ...")
    assert not kept("ST202", 400, "response_format", "response_format: invalid regex: at 1(8): ...")
    assert not kept("ST202", 400, "response_format", "a regex response_format cannot be combined with tools (...)")
    # the document states response_format's shape: refusing one is a finding
    assert kept("ST202", 400, "response_format", 'response_format must be an object with a "type"')
    assert kept("ST202", 400, "response_format", "response_format.json_schema.json_schema.name: Field required")
    assert kept("ST202", 400, "tools", "tools.0.function.name: String should match pattern")  # the document says it


@pytest.mark.parametrize("family", ["llada", "gemma"])
def test_schemathesis_default_checks_find_nothing(request, family, tmp_path):
    # The command of docs/bench.md ("Other clients"): default checks, one hook for the two rules that
    # relate fields (fluxlab/server/schemathesis_hooks.py); bounded examples, a fixed seed.
    server = request.getfixturevalue("server" if family == "llada" else "gemma_server")
    argv = [sys.executable, "-m", "schemathesis.cli", "run", f"{server.url}/openapi.json",
            "--max-examples", "20", "--seed", "0"]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "fluxlab.server.schemathesis_hooks"}
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    tail = (result.stdout + result.stderr)[-6000:]
    assert result.returncode == 0, tail
    generated = re.search(r"(\d+) generated", tail)
    assert generated and int(generated.group(1)) >= 200, tail  # it really fuzzed
