"""Tensor/expert parallelism on CPU with gloo (tiny model, fp32, temperature 0): every TP/EP layout
gives the tp_size=1 tokens and logits, a dead worker is an error (not a hang), shutdown leaves no
child process. `pytest -m gpu`: tp2_ep2 on two GPUs."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fluxlab.engine.runner_inputs import StepInputs
from fluxlab.models.llada2.model import LLaDA2MoeConfig, check_parallel
from fluxlab.engine.request import SamplingParams
from fluxlab.llm import LLM

BL = 16
BASE = ["model=tiny_llada2", "engine.dtype=float32", "engine.device=cpu", f"decoding.block_length={BL}", "model.max_model_len=256",
        "scheduler.max_num_seqs=4", "scheduler.max_scheduled_tokens=128", "parallel.startup_timeout_s=300"]
PROMPTS = ["Janet has 16 eggs. She eats three for breakfast and", "The ducks at the market", "Let us think"]
PARAMS = SamplingParams(max_new_tokens=32, temperature=0.0)


@pytest.fixture(scope="module")
def tp1() -> LLM:
    return LLM(overrides=BASE)


@pytest.fixture(scope="module")
def tp1_tokens(tp1) -> list[list[int]]:
    return [r.token_ids for r in tp1.generate(PROMPTS, PARAMS)]


def direct_forward(llm: LLM):
    """Logits of one prefill+decode row of two blocks, run through the runner directly, on two pages
    the block manager hands out and takes back: a page the prefix cache holds is never overwritten."""
    from fluxlab.engine.sequence import Request

    engine = llm.engine
    vocab_size = engine.model_config.vocab_size
    ids = np.array([(7 * i + 3) % vocab_size for i in range(2 * BL)])
    holder = Request("direct-forward", ids.tolist(), SamplingParams(max_new_tokens=1, steps=1), BL,
                     engine.mask_id, engine.eos_ids)
    engine.block_manager.allocate(holder, 2)
    try:
        inputs = StepInputs(ids, np.arange(2 * BL), [(0, 2, True, list(holder.page_table))], np.arange(BL, 2 * BL))
        if engine.runner.on_step is not None:
            engine.runner.on_step(inputs)  # the workers run the same forward
        _, logits, _, _ = engine.runner.execute(inputs)
        return logits
    finally:
        engine.block_manager.free(holder)


def parallel_llm(*overrides: str) -> LLM:
    return LLM(overrides=BASE + list(overrides))


def assert_matches_tp1(llm: LLM, tp1: LLM, tp1_tokens) -> None:
    got = [r.token_ids for r in llm.generate(PROMPTS, PARAMS)]
    assert got == tp1_tokens
    want = direct_forward(tp1)
    logits = direct_forward(llm)
    # Row-parallel sums only reorder fp32 additions. The tiny model's logits reach ~80, where one
    # fp32 ulp is ~1e-5, so the bound is 1e-5 of the logit scale (measured: ~3e-5 absolute).
    assert logits.shape == want.shape
    assert (logits - want).abs().max() <= 1e-5 * want.abs().max()
    assert torch.equal(logits.argmax(-1), want.argmax(-1))
    assert llm.engine.kv_free_pages == llm.engine.kv_total_pages


def child_pids() -> list[int]:
    """This process's live children (workers are plain subprocesses, not multiprocessing's)."""
    pids = []
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            pids += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:  # the thread ended between the listing and the read
            continue
    return pids


def assert_no_children(llm: LLM, exit_codes: tuple = (0,)) -> None:
    workers = list(llm.engine._workers.values())
    started = time.monotonic()
    llm.shutdown()
    # Quick, and each worker left on the shutdown message (exit 0), not killed after the 10 s join
    # (a graceful NCCL destroy was seen to hang there on GPUs).
    assert time.monotonic() - started < 10.0
    assert [p.exitcode for p in workers] == [exit_codes[i % len(exit_codes)] for i in range(len(workers))]
    assert not torch.distributed.is_initialized()
    assert child_pids() == []
    for process in workers:
        with pytest.raises(ProcessLookupError):
            os.kill(process.pid, 0)


@pytest.mark.parametrize("layout", ["parallel=tp2_ep2", "parallel=tp2"])
def test_two_ranks_give_tp1_tokens_and_logits(tp1, tp1_tokens, layout):
    llm = parallel_llm(layout)
    try:
        assert llm.engine.model.num_local_heads == 2 and llm.engine.model.num_local_kv_heads == 1
        assert_matches_tp1(llm, tp1, tp1_tokens)
    finally:
        assert_no_children(llm)


def test_workers_get_per_step_differences_and_leave_no_shared_memory(tp1_tokens):
    """Workers build no tokenizer or scheduler; a decode step sends a few bytes a row (changed
    tokens, not the batch), and the step channel leaves nothing in /dev/shm."""
    shm_before = set(os.listdir("/dev/shm"))
    llm = parallel_llm("parallel=tp2")
    try:
        worker = subprocess.run(["cat", f"/proc/{llm.engine._workers[1].pid}/cmdline"], capture_output=True).stdout
        assert b"fluxlab.engine.distributed.worker" in worker
        assert [r.token_ids for r in llm.generate(PROMPTS, PARAMS)] == tp1_tokens
        engine = llm.engine
        steps, sent = engine._channels[0].num_steps, engine.step_bytes_sent
        prompt = [(13 * i + 5) % 1800 + 3 for i in range(40)]  # 2.5 blocks, in no cache
        engine.add_request(prompt, SamplingParams(max_new_tokens=48, temperature=0.0))
        engine.step()  # prefill + first decode step: the prompt's tokens (8 bytes each) and pages
        assert engine.step_bytes_sent - sent >= 8 * len(prompt)
        sent = engine.step_bytes_sent
        engine.step()  # one decode row: header, row, the filled positions, bitmask, doorbell
        assert engine.step_bytes_sent - sent <= 40 + 12 + 8 * BL + 4 + 12
        while engine.has_unfinished():
            engine.step()
        assert engine._channels[0].num_steps > steps + 2
    finally:
        assert_no_children(llm)
    assert set(os.listdir("/dev/shm")) <= shm_before


def test_four_ranks_replicate_kv_heads_and_give_tp1_tokens(tp1, tp1_tokens):
    llm = parallel_llm("parallel=tp4_ep4")  # tiny: 4 heads, 2 kv heads -> each kv head on 2 ranks
    try:
        model = llm.engine.model
        assert (model.num_local_heads, model.num_local_kv_heads) == (1, 1)
        assert model.layers[1].mlp.experts.w_gate_up.shape[0] == 16 // 4
        assert [r.token_ids for r in llm.generate(PROMPTS, PARAMS)] == tp1_tokens
    finally:
        assert_no_children(llm)


def test_dp_attention_gives_tp1_tokens_and_logits_with_requests_on_both_ranks(tp1, tp1_tokens):
    """Attention and KV whole on each rank, each rank its own requests; experts split across ranks."""
    shm_before = set(os.listdir("/dev/shm"))
    llm = parallel_llm("parallel=dp2_ep2_attn")
    try:
        engine = llm.engine
        model = engine.model
        assert (model.num_local_heads, model.num_local_kv_heads) == (4, 2)  # tiny: all of them
        assert model.layers[1].mlp.experts.w_gate_up.shape[0] == 16 // 2
        for prompt in PROMPTS:
            engine.add_request(llm.encode(prompt), PARAMS)
        engine.step()
        assert {engine.block_manager.rank_of(r) for r in engine.scheduler.running} == {0, 1}
        engine.check_pages()
        while engine.has_unfinished():
            engine.step()
        assert_matches_tp1(llm, tp1, tp1_tokens)
        engine.check_pages()
    finally:
        assert_no_children(llm)
    assert set(os.listdir("/dev/shm")) <= shm_before


def test_dp4_attention_with_idle_ranks_and_sampled_rows_gives_tp1_tokens():
    """Four ranks, three requests, then one: idle ranks run a dummy block and still join every
    expert collective; a sampled row's full logits come back from its rank."""
    params = [PARAMS, SamplingParams(max_new_tokens=32, temperature=0.8, top_k=50, seed=3), PARAMS]
    reference = LLM(overrides=BASE)
    want = [r.token_ids for r in reference.generate(PROMPTS, params)]
    want_one = reference.generate(PROMPTS[2:], PARAMS)[0].token_ids
    reference.shutdown()
    llm = parallel_llm("parallel=dp4_ep4_attn")
    try:
        assert [r.token_ids for r in llm.generate(PROMPTS, params)] == want
        assert llm.generate(PROMPTS[2:], PARAMS)[0].token_ids == want_one
    finally:
        assert_no_children(llm)


def test_dp_attention_config_rules_name_the_keys():
    from fluxlab.config import compose, validate_config

    cfg = compose("generate", ["parallel=dp2_ep2_attn", "engine.device=cpu"])
    validate_config(cfg, cuda_available=False)
    assert (cfg.parallel.tp_size, cfg.parallel.dp_size, cfg.parallel.ep_size) == (2, 2, 2)
    cfg = compose("generate", ["parallel=dp4_ep4_attn", "engine.device=cpu", "parallel.ep_size=1"])
    with pytest.raises(ValueError, match=r"parallel.enable_dp_attention=true needs parallel.dp_size == "
                                         r"parallel.ep_size == parallel.tp_size > 1.*ep_size=1"):
        validate_config(cfg, cuda_available=False)


SCRIPT = """
import json
from fluxlab.llm import LLM
from fluxlab.engine.request import SamplingParams
llm = LLM(model="tiny_llada2", overrides={overrides!r})
out = llm.generate({prompts!r}, SamplingParams(max_new_tokens={max_new}, temperature=0.0))
print("RESULT", json.dumps({{"tokens": [o.token_ids for o in out],
                            "workers": [w.pid for w in llm.engine._workers.values()]}}))
{ending}
"""


@pytest.mark.parametrize("how", ["stdin", "dash_c"])
def test_tp2_runs_from_a_script_without_a_file(tp1_tokens, how):
    """`python - <<EOF` used to kill the worker (spawn re-imported `<stdin>`: FileNotFoundError);
    the -c script also skips shutdown(): the workers must still go at exit, with no semaphore leaked."""
    ending = "llm.shutdown()" if how == "stdin" else ""
    script = SCRIPT.format(overrides=[o for o in BASE if not o.startswith("model=")] + ["parallel=tp2"],
                           prompts=PROMPTS, max_new=PARAMS.max_new_tokens, ending=ending)
    cmd = [sys.executable, "-"] if how == "stdin" else [sys.executable, "-c", script]
    root = Path(__file__).resolve().parent.parent  # this checkout's fluxlab, as the test process imports it
    proc = subprocess.run(cmd, input=script if how == "stdin" else None, capture_output=True, text=True,
                          timeout=120, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [line] = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    result = json.loads(line[len("RESULT "):])
    assert result["tokens"] == tp1_tokens
    assert "leaked" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for pid in result["workers"]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_shard_statistics_combine_to_greedy_over_the_whole_row():
    """Shard (max, log-sum-exp, argmax) merged on rank 0 pick greedy's token (lowest index on ties,
    also across a shard boundary; padding never wins) and its probability within fp32 rounding."""
    from fluxlab.kernels.vocab_stats import combine_shard_stats, greedy_torch, shard_stats

    vocab = 1911
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(0)) * 5
    logits[0, [5, 1500]] = 50.0  # tie in different shards
    logits[1, [955, 956]] = 60.0  # tie across the tp2 boundary
    logits[2] = -30.0  # below the padding's zero logits
    logits[2, 1910] = -20.0
    want_tokens, want_prob = greedy_torch(logits)
    for tp in (2, 4):
        shard = -(-vocab // tp)
        padded = torch.full((6, shard * tp), float("-inf"))
        padded[:, :vocab] = logits
        stats = torch.stack([shard_stats(padded[:, r * shard:(r + 1) * shard]) for r in range(tp)])
        tokens, prob = combine_shard_stats(stats, shard)
        assert tokens.tolist() == want_tokens.tolist() and tokens[:3].tolist() == [5, 955, 1910]
        assert torch.allclose(prob, want_prob, rtol=1e-5, atol=0)


def test_greedy_and_sampled_rows_in_one_tp2_batch_give_tp1_tokens():
    """Greedy rows take the shard-statistics path, sampled rows the all-gathered logits, in the same step."""
    params = [PARAMS, SamplingParams(max_new_tokens=32, temperature=0.8, top_k=50, seed=3), PARAMS]
    reference = LLM(overrides=BASE)
    want = [r.token_ids for r in reference.generate(PROMPTS, params)]
    reference.shutdown()
    llm = parallel_llm("parallel=tp2")
    try:
        assert [r.token_ids for r in llm.generate(PROMPTS, params)] == want
    finally:
        assert_no_children(llm)


@pytest.mark.parametrize("layout", ["parallel=tp2_ep2", "parallel=dp2_ep2_attn"])
def test_a_worker_killed_mid_run_is_an_error_naming_the_rank_not_a_hang(layout):
    llm = parallel_llm(layout)
    try:
        engine = llm.engine
        engine.add_request(llm.encode(PROMPTS[0]), SamplingParams(max_new_tokens=64, temperature=0.0))
        engine.step()
        os.kill(engine._workers[1].pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank 1 exited with code -9"):
            for _ in range(50):
                engine.step()
        assert time.monotonic() - started < 30
    finally:
        assert_no_children(llm, exit_codes=(-9,))


def test_a_worker_failing_at_startup_is_reported_with_its_rank(monkeypatch):
    monkeypatch.setenv("FLUXLAB_FAIL_RANK", "1")
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)rank 1.*injected startup failure on rank 1"):
        parallel_llm("parallel=tp2_ep2", "parallel.startup_timeout_s=30")
    assert time.monotonic() - started < 30
    assert child_pids() == []
    # and the next engine in this process starts (the failed rendezvous left torch's group counter advanced)
    monkeypatch.delenv("FLUXLAB_FAIL_RANK")
    llm = parallel_llm("parallel=tp2", "parallel.startup_timeout_s=60")
    try:
        assert len(llm.generate([PROMPTS[0]], SamplingParams(max_new_tokens=8, temperature=0.0))[0].token_ids) > 0
    finally:
        llm.shutdown()


def test_model_specific_parallel_rules_name_the_keys_and_the_model_numbers():
    with pytest.raises(ValueError, match=r"parallel.tp_size=8 must divide the model's num_attention_heads=4"):
        parallel_llm("parallel.tp_size=8", "parallel.ep_size=8")
    c = LLaDA2MoeConfig(num_attention_heads=16, num_key_value_heads=4, num_experts=24, n_group=8)
    with pytest.raises(ValueError, match=r"parallel.ep_size=16 must divide the model's num_experts=24"):
        check_parallel(c, 16, 16)
    check_parallel(LLaDA2MoeConfig(), 8, 8)  # mini: 16 heads, 4 kv heads (replicated at tp 8), 256 experts


def test_tp4_ep4_group_validates():
    from fluxlab.config import compose, validate_config

    cfg = compose("generate", ["parallel=tp4_ep4", "engine.device=cpu"])
    validate_config(cfg, cuda_available=False)
    assert (cfg.parallel.tp_size, cfg.parallel.ep_size, cfg.parallel.distributed_backend) == (4, 4, "gloo")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_tp2_ep2_on_two_gpus_gives_tp1_tokens_and_logits():
    gpu = ["engine.device=cuda"]
    tp1 = LLM(overrides=BASE + gpu)
    tokens = [r.token_ids for r in tp1.generate(PROMPTS, PARAMS)]
    llm = parallel_llm("parallel=tp2_ep2", *gpu)
    try:
        assert llm.engine.cfg.parallel.distributed_backend == "nccl"
        assert_matches_tp1(llm, tp1, tokens)
    finally:
        assert_no_children(llm)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_tp2_ep2_with_flashinfer_and_decode_graphs_serves_and_shuts_down_cleanly():
    pytest.importorskip("flashinfer")
    llm = parallel_llm("parallel=tp2_ep2", "engine.device=cuda", "engine.dtype=bfloat16", "model.preset=small",
                       "model.load_format=random", "attention.use_decode_cuda_graph=true",
                       "attention.cuda_graph_capture_bs=[1,2,4]")
    try:
        assert llm.engine.runner.graphs and llm.engine.runner.backend == "flashinfer"
        outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=64, ignore_eos=True))
        assert [len(o.token_ids) for o in outs] == [64] * len(PROMPTS)
        assert llm.engine.kv_free_pages == llm.engine.kv_total_pages
    finally:
        assert_no_children(llm)
