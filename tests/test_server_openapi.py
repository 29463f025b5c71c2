"""The OpenAPI document tells the truth: schemathesis fuzzes the live server against it.

Bounded: about 20 examples per operation and phase (a few hundred requests), a small context so
each generation is short; on 2 CPU cores it takes well under a minute.
"""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from server_helpers import TINY, ServerProcess

CHECKS = ["not_a_server_error", "status_code_conformance", "content_type_conformance",
          "response_schema_conformance", "response_headers_conformance", "negative_data_rejection",
          "unsupported_method"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess(TINY + ["model.max_model_len=64", "model.max_new_tokens=16"],
                         tmp_path_factory.mktemp("openapi"))
    yield proc
    proc.stop()


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
    decoder = schemas["CompletionRequest"]["properties"]["decoder"]["anyOf"][0]
    from fluxlab.engine.decoding.registry import DECODERS

    assert decoder["enum"] == list(DECODERS)


def test_a_wrong_method_is_405_with_allow(server):
    response = server.get("/v1/completions")
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
    assert response.json()["error"]["code"] == "method_not_allowed"


def test_schemathesis_finds_no_server_error_and_no_nonconformance(server, tmp_path):
    argv = [sys.executable, "-m", "schemathesis.cli", "run", f"{server.url}/openapi.json",
            "--checks", ",".join(CHECKS), "--max-examples", "20", "--seed", "0", "--no-shrink",
            "--request-timeout", "60", "--max-failures", "20", "--workers", "1"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    tail = (result.stdout + result.stderr)[-6000:]
    assert result.returncode == 0, tail
    generated = re.search(r"(\d+) generated", tail)
    assert generated and int(generated.group(1)) >= 200, tail  # it really fuzzed
