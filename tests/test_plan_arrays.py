"""The attention plan's host arrays, built with numpy over the seats, equal the per-row construction
they replace (written out here as it was: a Python loop over (first_block, num_blocks, page_table)
rows), value for value and dtype for dtype, on hand-made rows and on every forward of real engine
runs (prefill chunks, commit + decode rows, decode rows, pages shared through the prefix cache)."""
from __future__ import annotations

import dataclasses
import random
import sys
import types
from itertools import chain

import numpy as np
import pytest
import torch

from fluxlab.engine.layers.attention import build_metadata
from fluxlab.engine.layers.page_tables import segment_tables
from fluxlab.engine.layers.attention_flashinfer import plan_indices
from fluxlab.engine.layers.segments import Segments
from fluxlab.engine.request import SamplingParams
from test_engine import BL, engine_llm, prompts


# --- the per-row constructions (before the seats' page mirror fed the plan) ---
def rowwise_flashinfer(rows, block_length):
    windows = [w for first, n, _ in rows for w in range(first + 1, first + n + 1)]
    kv_indptr = np.zeros(len(windows) + 1, dtype=np.int32)
    np.cumsum(windows, out=kv_indptr[1:])
    kv_indices = np.fromiter(chain.from_iterable(pages[:w] for first, n, pages in rows
                                                 for w in range(first + 1, first + n + 1)),
                             dtype=np.int32, count=int(kv_indptr[-1]))
    qo_indptr = np.arange(len(windows) + 1, dtype=np.int32) * block_length
    return qo_indptr, kv_indptr, kv_indices


def rowwise_fa4(rows, width, fill_page=0):
    num_segments = sum(n for _, n, _ in rows)
    table = np.full((num_segments, width), fill_page, dtype=np.int32)
    used = np.empty(num_segments, dtype=np.int32)
    s = 0
    for first, n, pages in rows:
        window = np.asarray(pages[:first + n], dtype=np.int32)
        for block in range(first, first + n):
            table[s, :block + 1] = window[:block + 1]
            used[s] = block + 1
            s += 1
    return table, used


def rowwise_slots(rows, block_length):
    pages = torch.tensor([p for first, n, table in rows for p in table[first:first + n]], dtype=torch.long)
    return (pages[:, None] * block_length + torch.arange(block_length)).flatten()


def rowwise_dense(rows, bl):
    """sdpa's padded view: (page_indices, query_gather, query_scatter, mask)."""
    num_rows = len(rows)
    q_lens = torch.tensor([n * bl for _, n, _ in rows])
    windows = torch.tensor([first + n for first, n, _ in rows])
    max_q, max_pages = int(q_lens.max()), int(windows.max())
    page_idx = torch.zeros(num_rows, max_pages, dtype=torch.long)
    for r, (first, n, table) in enumerate(rows):
        page_idx[r, :first + n] = torch.tensor(table[:first + n])
    q_offsets = torch.cumsum(q_lens, 0) - q_lens
    q_pos = torch.arange(max_q)[None, :]
    q_valid = q_pos < q_lens[:, None]
    gather = torch.where(q_valid, q_offsets[:, None] + q_pos, 0)
    scatter = (torch.arange(num_rows)[:, None] * max_q + q_pos)[q_valid]
    first_block = torch.tensor([first for first, _, _ in rows])
    q_block = torch.where(q_valid, first_block[:, None] + q_pos // bl, -1)
    key = torch.arange(max_pages * bl)[None, None, :]
    mask = ((key // bl) <= q_block[:, :, None]) & (key < (windows * bl)[:, None, None])
    mask[:, :, 0] |= ~q_valid
    return page_idx, gather, scatter, mask[:, None]


def assert_same(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.array_equal(got, want)


def assert_plans_equal(segments: Segments, rows, bl: int, width: int) -> None:
    for got, want in zip(plan_indices(segments, bl), rowwise_flashinfer(rows, bl)):
        assert_same(got, want)
    for got, want in zip(segment_tables(segments, width, fill_page=7), rowwise_fa4(rows, width, fill_page=7)):
        assert_same(got, want)
    slots = torch.from_numpy(segments.slot_mapping(bl))
    assert slots.dtype == torch.long and torch.equal(slots, rowwise_slots(rows, bl))
    meta = build_metadata(segments, bl, torch.device("cpu"))
    for got, want in zip((meta.page_indices, meta.query_gather, meta.query_scatter, meta.mask), rowwise_dense(rows, bl)):
        assert got.dtype == want.dtype and torch.equal(got, want)


def assert_same_inputs(inputs, decode_inputs, want, want_decode) -> None:
    for name in ("token_ids", "positions", "logit_index"):
        assert_same(getattr(inputs, name), getattr(want, name))
    assert inputs.num_greedy == want.num_greedy
    for name in ("tables", "windows", "row_segments"):
        assert_same(getattr(inputs.segments, name), getattr(want.segments, name))
    assert (decode_inputs is None) == (want_decode is None)
    if decode_inputs is not None:
        for name in ("slots", "block_index", "greedy_target", "full_rows", "log_len", "owners"):
            assert_same(getattr(decode_inputs, name), getattr(want_decode, name))
        assert decode_inputs.requests == want_decode.requests and decode_inputs.decoders == want_decode.decoders


def random_rows(rng: random.Random, num_rows: int, shared: bool):
    """Rows of every kind: decode (1 block), commit + decode (2), prefill chunks (up to 5), tables
    longer than the window (pages allocated ahead); `shared`: rows that start on the same prefix pages."""
    pages = list(range(1000))
    rng.shuffle(pages)
    prefix = [pages.pop() for _ in range(4)]
    rows = []
    for _ in range(num_rows):
        first = rng.randrange(0, 6)
        n = rng.choice([1, 1, 2, 2, 3, 5])
        own = rng.randrange(first + n, first + n + 3)
        table = [pages.pop() for _ in range(own)]
        if shared and rng.random() < 0.5:
            table[:min(4, own)] = prefix[:min(4, own)]
        rows.append((first, n, table))
    return rows


@pytest.mark.parametrize("num_rows", [1, 3, 16, 64])
@pytest.mark.parametrize("shared", [False, True])
def test_vectorised_plan_equals_the_rowwise_plan_on_random_rows(num_rows, shared):
    rng = random.Random(num_rows * 2 + shared)
    for _ in range(5):
        rows = random_rows(rng, num_rows, shared)
        assert_plans_equal(Segments.of_rows(rows), rows, 16, width=12)


def test_padding_and_row_ranges_are_the_rowwise_plan_of_the_same_rows():
    """What a graph replay plans: real rows, then scratch rows on one page; decomposed chunks."""
    rows = random_rows(random.Random(5), 9, shared=True)
    segments = Segments.of_rows(rows)
    padded = segments.padded(6, 999)
    assert_plans_equal(padded, rows + [(0, 1, [999])] * 6, 16, width=12)
    assert_plans_equal(Segments.scratch(4, 999), [(0, 1, [999])] * 4, 16, width=12)
    for start, stop in [(0, 1), (2, 5), (5, 9)]:
        assert_plans_equal(segments.rows_range(start, stop), rows[start:stop], 16, width=12)


def test_fa4_tables_refuse_a_window_past_their_width():
    with pytest.raises(ValueError, match="table width 3"):
        segment_tables(Segments.of_rows([(2, 2, [1, 2, 3, 4])]), width=3)


@pytest.mark.parametrize("policy,prefix_cache", [("paged", "true"), ("dynamic", "true"), ("dynamic", "false")])
def test_every_engine_forward_plans_what_its_rows_page_tables_give(monkeypatch, policy, prefix_cache):
    """The runner builds each forward's segments from the seats' page mirror; they equal the plan of
    its rows built from each request's own page table, forward by forward (prompts sharing a
    prefix, so cached pages are shared; budgets that chunk prefills; commit + decode rows; greedy,
    editing and sampled rows), and what prepare reuses for a batch of the same rows equals a fresh build."""
    llm = engine_llm(f"scheduler={policy}", f"scheduler.enable_prefix_cache={prefix_cache}",
                     f"scheduler.max_scheduled_tokens={6 * BL}", "scheduler.max_num_seqs=4")
    engine = llm.engine
    runner = engine.runner
    seen = {"forwards": 0, "multi_block": 0, "single": 0, "shared": 0, "same_rows": 0}
    prepare_decode = runner.prepare_decode

    def checked_prepare(batch, inputs):  # the step's second half: inputs has every field now
        decode_inputs = prepare_decode(batch, inputs)
        if batch.same_rows:  # what prepare reused from the last batch equals what it derives afresh
            seen["same_rows"] += 1
            afresh = dataclasses.replace(batch, same_rows=False)
            fresh = runner.prepare_forward(afresh)
            fresh_decode = prepare_decode(afresh, fresh)
            assert_same_inputs(inputs, decode_inputs, fresh, fresh_decode)
        rows = [(f, n, list(r.page_table)) for r, f, n in zip(batch.requests, batch.first_block.tolist(),
                                                               batch.num_blocks.tolist())]
        assert_plans_equal(inputs.segments, rows, BL, width=runner.max_blocks_per_seq)
        seen["forwards"] += 1
        seen["multi_block"] += int((batch.num_blocks > 1).any())
        seen["single"] += int(batch.single_blocks)
        pages = [p for _, _, t in rows for p in t]
        seen["shared"] += int(len(pages) != len(set(pages)))
        return decode_inputs

    monkeypatch.setattr(runner, "prepare_decode", checked_prepare)
    shared = prompts(llm, [3 * BL + 5], seed=11)[0]
    batch = [shared + p for p in prompts(llm, [3, BL + 7, 9], seed=12)] + prompts(llm, [2 * BL + 3, 5], seed=13)
    params = SamplingParams(max_new_tokens=2 * BL, ignore_eos=True)
    # an editing decoder (greedy logits past the masks) and a sampled row (whole-block logits) too
    mixed = [params, params, SamplingParams(max_new_tokens=2 * BL, ignore_eos=True, decoder="joint_threshold"),
             SamplingParams(max_new_tokens=2 * BL, ignore_eos=True, temperature=0.8, seed=3), params]
    first = llm.generate(batch[:2], params)  # leaves the shared prefix in the cache
    second = llm.generate(batch, mixed)
    assert [r.token_ids for r in second[:2]] == [r.token_ids for r in first]
    assert seen["multi_block"] and seen["single"] and seen["same_rows"] and seen["forwards"] > 10
    if prefix_cache == "true":
        assert seen["shared"]


class _FakeWrapper:
    """Records FlashInfer plans (CPU: the real wrapper needs CUDA); fails when `fail` is set."""

    def __init__(self, *args, **kwargs):
        self.plans, self.fail = [], False

    def reset_workspace_buffer(self, float_buffer, int_buffer):
        pass

    def plan(self, qo_indptr, kv_indptr, kv_indices, last_page_len, *args, **kwargs):
        if self.fail:
            raise RuntimeError("plan failed")
        self.plans.append(kv_indices.tolist())


def test_a_wrapper_replans_only_when_the_shared_int_buffer_holds_another_plan(monkeypatch):
    """Skipping FlashInfer's plan is exact only while the shared int buffer holds this wrapper's plan
    of these very arguments: another wrapper's plan in between, other segments (equal ones included)
    or a failed plan make the next plan run."""
    from fluxlab.engine.layers import attention_flashinfer as fi

    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=_FakeWrapper))
    cache = types.SimpleNamespace(block_length=BL, k=torch.zeros(1, dtype=torch.float32))
    config = types.SimpleNamespace(num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    workspace = fi.SharedWorkspace(torch.device("cpu"))
    graph_a, graph_b = (fi.FlashInferAttention(cache, config, torch.device("cpu"), graph_segments=4, graph_max_pages=16,
                                               workspace=workspace) for _ in range(2))
    rows = [(0, 1, [3, 4]), (1, 1, [5, 6])]
    segments = Segments.of_rows(rows)
    graph_a.plan(segments)
    graph_a.plan(segments)  # the decode steps of a block: the same rows, the same segments
    assert graph_a.wrapper.plans == [[3, 5, 6]]
    graph_b.plan(segments)
    graph_a.plan(segments)  # b's plan overwrote the int buffer
    assert graph_a.wrapper.plans == [[3, 5, 6]] * 2 and graph_b.wrapper.plans == [[3, 5, 6]]
    graph_a.plan(Segments.of_rows(rows))  # equal rows, new segments: planned again
    assert len(graph_a.wrapper.plans) == 3
    graph_a.wrapper.fail = True
    with pytest.raises(RuntimeError):
        graph_a.plan(segments)
    graph_a.wrapper.fail = False
    graph_a.plan(segments)  # after a failed plan the buffer holds no known plan
    assert len(graph_a.wrapper.plans) == 4


def test_an_fa4_graph_rewrites_its_tables_only_for_other_segments(monkeypatch):
    """A graph's FA4 page table and lengths: the host writes them into its own mapped tables, which
    the graph's first kernel copies into the buffers the attention reads. The same segments again
    (a block's decode steps) leave the host tables as they are, other segments rewrite them."""
    from fluxlab.engine.layers.attention_fa4 import Fa4Attention

    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_varlen_func = None
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    cache = types.SimpleNamespace(block_length=BL)
    graph = Fa4Attention(cache, torch.device("cpu"), num_qo_heads=2, head_dim=8, max_blocks_per_seq=3, graph_segments=2)
    first, other = Segments.of_rows([(0, 1, [3]), (1, 1, [5, 6])]), Segments.of_rows([(0, 2, [4, 2])])

    def copied_in() -> tuple[list, list]:
        graph.page_table.fill_(-1)
        graph.seqused_k.fill_(-1)
        graph.copy_plan_in()  # what the graph's first kernel does
        return graph.page_table.tolist(), graph.seqused_k.tolist()

    graph.plan(first)
    assert copied_in() == ([[3, 0, 0], [5, 6, 0]], [BL, 2 * BL])
    graph._host_plan.fill(9)  # marks the host tables: a skipped plan leaves the mark
    graph.plan(first)
    assert copied_in() == ([[9] * 3] * 2, [9, 9])
    graph.plan(other)
    assert copied_in() == ([[4, 0, 0], [4, 2, 0]], [BL, 2 * BL])
    graph.plan(first)
    assert copied_in() == ([[3, 0, 0], [5, 6, 0]], [BL, 2 * BL])
