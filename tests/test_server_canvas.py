"""`fluxlab serve model=tiny_diffusion_gemma`: canvas knobs per request through the HTTP body, the
same tokens as the offline engine (which equals transformers, test_canvas_engine.py)."""
from __future__ import annotations

import pytest

from fluxlab.engine.request import SamplingParams
from fluxlab.llm import LLM
from server_helpers import ServerProcess

MODEL = "tiny_diffusion_gemma"
BASE = [f"model={MODEL}", "engine.dtype=float32", "engine.device=cpu"]
SERVE = BASE + ["server.host=127.0.0.1", "server.port=0", "server.log_level=warning"]
PROMPT = [5, 17, 301, 44, 9, 1200, 77, 3, 18, 250, 11]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess(SERVE, tmp_path_factory.mktemp("serve_canvas"))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def offline():
    return LLM(overrides=BASE)


def complete(server, **body) -> dict:
    response = server.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 20,
                                                    "return_token_ids": True, **body})
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("knobs", [{}, {"max_denoising_steps": 3, "entropy_bound": 2.5, "t_min": 0.2, "t_max": 0.9,
                                        "stability_threshold": 1, "confidence_threshold": 0.9}])
def test_served_tokens_equal_the_offline_engine(server, offline, knobs):
    for seed in (0, 5):
        served = complete(server, seed=seed, **knobs)
        want = offline.generate([PROMPT], [SamplingParams(max_new_tokens=20, seed=seed, **knobs)])[0]
        assert served["choices"][0]["token_ids"] == want.token_ids
        assert served["usage"]["fluxlab"]["forwards"] == want.stats.forwards


def test_denoising_steps_per_request_bound_the_forwards(server):
    usage = complete(server, seed=1, max_denoising_steps=2, ignore_eos=True)["usage"]["fluxlab"]
    assert usage["forwards"] <= 2 * 3  # three canvases of 8 for 20 tokens, at most 2 steps each


@pytest.mark.parametrize("body,param", [({"entropy_bound": 0}, "entropy_bound"), ({"t_min": -1}, "t_min"),
                                        ({"t_min": 0.9, "t_max": 0.5}, "t_max"), ({"temperature": 0.5}, "temperature"),
                                        ({"max_denoising_steps": 0}, "max_denoising_steps"),
                                        ({"decoder": "threshold"}, "decoder")])
def test_bad_canvas_knobs_are_400_naming_the_field(server, body, param):
    response = server.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 8, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_chat_completion_is_served(server):
    response = server.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 12, "seed": 3,
                                                         "messages": [{"role": "user", "content": "Hi there"}]})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"]["completion_tokens"] >= 1 and body["choices"][0]["finish_reason"] in ("stop", "length")
