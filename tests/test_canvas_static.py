"""The static denoising path (what a Diffusion-Gemma CUDA graph holds), called as is on CPU: rows
padded to a ladder size, prefix keys to a power of two pages, per-row buffers, the sampler in
tensors. It gives transformers' tokens (and so the eager path's) for batches that need padding."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from fluxlab.llm import LLM
from test_canvas_engine import BASE, cases, check, prompt_ids


def static_llm(row_sizes: list[int], *overrides: str) -> LLM:
    llm = LLM(overrides=BASE + list(overrides))
    llm.engine.runner.enable_denoise_graphs(row_sizes, capture=False)
    return llm


def count_static_steps(llm: LLM, monkeypatch) -> list[tuple[int, int, int]]:
    """(rows, padded rows, rows that commit first) of every step the static path ran."""
    graphs = llm.engine.runner.graphs
    runs, run = [], graphs.run

    def counted(requests, states, commits):
        runs.append((len(requests), next(s for s in graphs.sizes if s >= len(requests)), sum(commits)))
        return run(requests, states, commits)

    monkeypatch.setattr(graphs, "run", counted)
    return runs


@pytest.fixture(scope="module")
def hf(one_thread):
    from transformers import DiffusionGemmaForBlockDiffusion

    from fluxlab.models.diffusion_gemma.checkpoint import PRESET
    from fluxlab.checkpoint import ensure_tiny_checkpoint

    path = ensure_tiny_checkpoint(preset=PRESET)
    return DiffusionGemmaForBlockDiffusion.from_pretrained(str(path), dtype=torch.float32).eval()


def test_padded_static_path_equals_transformers(hf, monkeypatch):
    """Ladder [2, 4] with 4 seats: batches of 1 and 3 denoising rows are padded (to 2 and 4); rows
    that prefill several blocks run eagerly in the same run."""
    llm = static_llm([2, 4])
    runs = count_static_steps(llm, monkeypatch)
    check(llm, hf, cases(llm.engine.model_config.vocab_size))
    assert {n for n, padded, _ in runs if padded > n} >= {1, 3}
    assert llm.engine.runner.num_eager_forwards > len(runs) > 0  # un-captured static steps count as eager


@pytest.mark.parametrize("policy", ["paged", "dynamic"])
def test_commit_graph_commits_a_canvas_while_denoising_the_next(hf, monkeypatch, policy):
    """Four requests, several canvases each, early stops at different steps: a canvas is committed
    in the forward that denoises the next one. Paged commits every row together (also in a padded
    batch); dynamic commits some rows beside rows that only denoise (their dummy block goes to the
    scratch page)."""
    llm = static_llm([2, 4], f"scheduler={policy}")
    runs = count_static_steps(llm, monkeypatch)
    vocab = llm.engine.model_config.vocab_size
    check(llm, hf, [(prompt_ids(n, s, vocab), s, m) for n, s, m in ((8, 0, 24), (13, 1, 20), (16, 2, 24),
                                                                        (21, 3, 17))])
    if policy == "paged":
        assert any(commits == n > 1 for n, _, commits in runs)
        assert any(padded > n and commits for n, padded, commits in runs)
    else:
        assert any(0 < commits < n for n, _, commits in runs)


def test_every_batch_padded_to_one_size_and_dynamic_policy(hf, monkeypatch):
    llm = static_llm([4], "scheduler=dynamic")
    runs = count_static_steps(llm, monkeypatch)
    check(llm, hf, cases(llm.engine.model_config.vocab_size, seeds=(2, 3)))
    assert any(n < 4 for n, *_ in runs)


def test_knobs_and_preemption_through_the_static_path(hf, monkeypatch):
    """Per-request knobs are per-row buffers; preemption (6 pages for 4 seats) keeps each request's
    state, which the static path reads back in whatever row it lands."""
    llm = static_llm([1, 2, 4], "scheduler.num_device_pages=6")
    runs = count_static_steps(llm, monkeypatch)
    vocab = llm.engine.model_config.vocab_size
    knobs = dict(max_denoising_steps=3, entropy_bound=2.0, t_min=0.3, t_max=0.9, stability_threshold=1,
                 confidence_threshold=0.8)
    check(llm, hf, [(prompt_ids(5, 7, vocab), 7, 12), (prompt_ids(11, 8, vocab), 8, 12)], **knobs)
    results = check(llm, hf, cases(vocab, max_new=(20, 13)))
    assert sum(r.stats.preemptions for r in results) > 0 and runs


def test_static_step_matches_eager_step_values(one_thread):
    """One step of three mid-canvas rows padded to 4: canvases, stopping history and generator
    states equal the eager path's; the self-conditioning inputs agree to fp32 rounding (not bit for
    bit: full layers gather 16 prefix keys where the eager batch gathers its longest row's 13, and
    CPU sdpa blocks a longer key axis differently; the eager path pads every row to its batch's
    longest prefix the same way, which is why parity with transformers is per token)."""
    from fluxlab.engine.batch import ScheduledBatch, ScheduledRow

    eager, static = LLM(overrides=BASE), static_llm([4])
    vocab = eager.engine.model_config.vocab_size
    params = [dict(max_new_tokens=16, seed=s) for s in (0, 1, 2)]
    from fluxlab.engine.request import SamplingParams

    states = []
    for llm in (eager, static):
        engine = llm.engine
        for i, p in enumerate(params):
            engine.add_request(prompt_ids(5 + 4 * i, i, vocab), SamplingParams(**p))
        for _ in range(4):  # prefill, then denoising steps
            engine.step()
        requests = list(engine.requests.values())
        batch = ScheduledBatch.of_rows([ScheduledRow(r, r.active_block, 1, True) for r in requests],
                                       engine.block_length)
        assert llm is eager or engine.runner.graphs.can_run(batch)
        out = engine.runner.run(batch)
        states.append((out, [r.canvas for r in requests]))
    (out_e, st_e), (out_s, st_s) = states
    assert (out_e.blocks == out_s.blocks).all() and (out_e.final == out_s.final).all()
    for a, b in zip(st_e, st_s):
        assert torch.equal(a.canvas, b.canvas)
        torch.testing.assert_close(a.soft_embeds, b.soft_embeds, rtol=1e-5, atol=1e-4)
        assert torch.equal(a.prev_argmax, b.prev_argmax) and int(a.stable_run) == int(b.stable_run)
        assert a.forwards == b.forwards and torch.equal(a.generator.get_state(), b.generator.get_state())


def test_decode_graph_keys_are_honoured_or_refused_by_name():
    from fluxlab.config import ConfigError, compose, validate_config

    def valid(*overrides, cuda=True):
        cfg = compose("serve", ["model=tiny_diffusion_gemma", *overrides])
        validate_config(cfg, cuda_available=cuda)
        return cfg

    cfg = valid("attention.use_decode_cuda_graph=true", "scheduler.max_num_seqs=8")
    auto = "triton" if importlib.util.find_spec("triton") else "sdpa"  # bf16 on CUDA: the canvas kernel
    assert cfg.attention.backend == auto and list(cfg.attention.cuda_graph_capture_bs) == [1, 2, 4, 8]
    assert valid("attention.use_cuda_graph=true").attention.use_decode_cuda_graph
    assert list(valid("attention.use_decode_cuda_graph=true", "attention.cuda_graph_capture_bs=[3,1]")
                .attention.cuda_graph_capture_bs) == [1, 3]
    for overrides, message in (
            (["attention.use_prefill_cuda_graph=true"], "attention.use_prefill_cuda_graph=true: model=tiny_diffusion"),
            (["attention.use_decode_cuda_graph=true", "attention.cuda_graph_decode_mode=decomposed"],
             "attention.cuda_graph_decode_mode=decomposed: model=tiny_diffusion_gemma"),
            (["attention=flashinfer", "attention.use_decode_cuda_graph=true"], "attention.backend=flashinfer")):
        with pytest.raises(ConfigError, match=message):
            valid(*overrides)
    with pytest.raises(ConfigError, match="need a CUDA device"):
        valid("attention.use_decode_cuda_graph=true", "engine.device=cpu", cuda=False)


def test_row_ladder_and_key_buckets():
    from fluxlab.models.diffusion_gemma.graphs import denoise_row_sizes

    assert denoise_row_sizes([1, 16, 64], 4) == [1] + list(range(4, 65, 4))
    assert denoise_row_sizes([1, 2], 4) == [1, 2]
    llm = static_llm([2, 4])
    graphs, L = llm.engine.runner.graphs, llm.engine.block_length

    class Row:
        def __init__(self, block, pad):
            self.active_block, self.num_pad = block, pad

    assert graphs.key_pages([Row(1, 3)]) == 1 and graphs.key_pages([Row(2, 3), Row(3, 0)]) == 4
    assert graphs.key_pages([Row(60, 0)]) == graphs.max_key_pages == llm.engine.runner.pages_per_seq - 1
    assert L * graphs.max_key_pages >= llm.engine.max_model_len


def test_static_step_never_reads_the_device_back(one_thread):
    """A CUDA graph cannot hold a host sync or a data-dependent shape: the static step (forward,
    logits, sampler, self-conditioning) calls none of the ops that need one."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fluxlab.engine.request import SamplingParams

    llm = static_llm([4])
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    for i in range(3):
        engine.add_request(prompt_ids(5 + 4 * i, i, vocab), SamplingParams(max_new_tokens=16, seed=i))
    for _ in range(3):
        engine.step()
    requests = list(engine.requests.values())

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    ops = Ops()
    with torch.inference_mode():
        for commits in (False, True):  # the denoise-only graph and the commit graph
            denoiser = engine.runner.graphs.denoiser(len(requests), engine.runner.graphs.key_pages(requests),
                                                     commits=commits)
            L = engine.block_length  # a row can commit the block before its canvas if it holds no padding
            rows_commit = [commits and r.num_pad <= (r.active_block - 1) * L for r in requests]
            assert any(rows_commit) or not commits
            denoiser.load(requests, [r.canvas for r in requests], rows_commit)
            with ops:
                denoiser._step(denoiser.generators)
    syncing = {"_local_scalar_dense", "item", "nonzero", "_unique2", "unique_dim", "unique_consecutive", "bincount",
               "masked_select", "is_nonzero", "equal", "repeat_interleave", "multinomial"}
    assert {"scaled_dot_product_attention", "exponential_", "randint", "sort", "index_put_"} <= ops.names
    assert not ops.names & syncing


def test_batches_past_the_largest_size_run_eagerly(hf, monkeypatch):
    """Ladder [2] with 4 seats: denoising batches of 3-4 rows take the eager path, smaller ones the
    static path, in one run; tokens stay transformers'."""
    llm = static_llm([2])
    runs = count_static_steps(llm, monkeypatch)
    runner, eager_denoise = llm.engine.runner, []
    rows = runner._rows

    def recorded(batch):
        if batch.decodes.all() and (batch.num_blocks == 1).all():
            eager_denoise.append(len(batch.requests))
        return rows(batch)

    monkeypatch.setattr(runner, "_rows", recorded)
    check(llm, hf, cases(llm.engine.model_config.vocab_size)[:6])
    assert runs and max(n for n, *_ in runs) <= 2
    assert eager_denoise and min(eager_denoise) > 2
