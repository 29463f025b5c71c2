"""A tensor-parallel server whose worker dies stops with a clear message instead of hanging."""
from __future__ import annotations

import os
import signal
from pathlib import Path

from fluxlab.bench.soak import descendants
from server_helpers import ServerProcess, assert_server_goes_down

OVERRIDES = ["model=tiny_llada2", "parallel=tp2_ep2", "engine.device=cpu", "engine.dtype=float32", "decoding.block_length=16",
             "model.max_model_len=256", "server.host=127.0.0.1", "server.port=0"]


def spawned_workers(pid: int) -> list[int]:
    """The TP worker processes under the server (its engine process starts them)."""
    return [c for c in descendants(pid)
            if "fluxlab.engine.distributed.worker" in Path(f"/proc/{c}/cmdline").read_bytes().decode(errors="replace")]


def test_a_dead_worker_takes_the_server_down_with_a_clear_message(tmp_path):
    server = ServerProcess(OVERRIDES, tmp_path)
    try:
        body = {"model": "tiny_llada2", "prompt": "Hello there", "max_tokens": 16}
        assert server.post("/v1/completions", json=body).status_code == 200
        [worker] = spawned_workers(server.proc.pid)
        os.kill(worker, signal.SIGKILL)
        assert_server_goes_down(server, body, "rank 1 exited with code -9")
    finally:
        server.kill()


def test_dp_attention_serves_one_endpoint_with_tp1_answers(tmp_path):
    """parallel=dp2_ep2_attn behind the same OpenAI server: concurrent requests spread over the two
    attention ranks, answers equal to one rank's (fp32, temperature 0)."""
    from concurrent.futures import ThreadPoolExecutor

    from fluxlab.engine.request import SamplingParams
    from fluxlab.llm import LLM

    prompts = ["Hello there", "The ducks at the market", "Let us think step by step"]
    reference = LLM(overrides=[o for o in OVERRIDES if not o.startswith(("parallel=", "server."))])
    want = [r.text for r in reference.generate(prompts, SamplingParams(max_new_tokens=16, temperature=0.0))]
    reference.shutdown()
    overrides = [o for o in OVERRIDES if not o.startswith("parallel=")] + ["parallel=dp2_ep2_attn"]
    server = ServerProcess(overrides, tmp_path)
    try:
        def complete(prompt: str) -> str:
            body = {"model": "tiny_llada2", "prompt": prompt, "max_tokens": 16, "temperature": 0.0}
            response = server.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["text"]

        with ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(complete, prompts)) == want
        assert len(spawned_workers(server.proc.pid)) == 1
    finally:
        server.kill()
