"""`fluxlab serve model=tiny_sdar`: SDAR's decoders and knobs per request through the OpenAI body, the same tokens
as the offline engine (which equals the published routines, test_sdar_engine.py); chat works on its template."""
from __future__ import annotations

import pytest

from fluxlab.engine.request import SamplingParams
from fluxlab.llm import LLM
from server_helpers import ServerProcess

MODEL = "tiny_sdar"
BASE = [f"model={MODEL}", "engine.dtype=float32", "engine.device=cpu", "model.max_model_len=256"]
SERVE = BASE + ["server.host=127.0.0.1", "server.port=0", "server.log_level=warning"]
PROMPT = [17, 250, 300, 12, 7, 901, 44]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess(SERVE, tmp_path_factory.mktemp("serve_sdar"))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def offline():
    return LLM(overrides=BASE)


@pytest.mark.parametrize("knobs", [{}, {"decoder": "bd3", "threshold": 1.0, "steps": 2, "temperature": 0.7},
                                   {"decoder": "sequential", "steps": 2, "top_p": 0.9},
                                   {"decoder": "low_confidence_static", "top_k": 20, "temperature": 0.0}])
def test_served_tokens_equal_the_offline_engine(server, offline, knobs):
    response = server.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "seed": 3,
                                                    "return_token_ids": True, **knobs})
    assert response.status_code == 200, response.text
    want = offline.generate([PROMPT], [SamplingParams(max_new_tokens=16, seed=3, **knobs)])[0]
    assert response.json()["choices"][0]["token_ids"] == want.token_ids


def test_chat_completion_answers(server):
    response = server.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 8, "seed": 0,
                                                         "messages": [{"role": "user", "content": "Hi"}]})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1


def test_an_unknown_decoder_is_a_400_naming_it(server):
    response = server.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4,
                                                    "decoder": "entropy_bounded"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "decoder"
