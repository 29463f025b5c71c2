"""The step pipeline's seams: the decoder registry is the one list of names and ranges, postprocess
is the one writer of request state, a failing row fails alone, logits are computed only where a
decoder may write, and the graph planner covers every batch shape."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fluxlab.engine.decoding.knobs import KNOBS
from fluxlab.engine.decoding.registry import DECODERS
from fluxlab.engine.graph_runner import plan_chunks
from fluxlab.engine.request import InvalidRequest, SamplingParams
from test_engine import BL, check_parity, engine_llm, prompts


@pytest.fixture(scope="module")
def llm():
    return engine_llm()


@pytest.mark.parametrize("knob,bad", [("threshold", 1.5), ("steps", BL + 1), ("top_p", 0.0), ("top_k", -1),
                                      ("max_post_steps", -2), ("temperature", float("inf"))])
def test_config_request_and_reference_refuse_the_same_values(llm, knob, bad):
    """One range per knob: config validation, SamplingParams and the reference all read KNOBS."""
    from fluxlab.config import ConfigError, compose, validate_config
    from fluxlab.models.llada2.reference import reference_generate

    message = KNOBS[knob].problem(bad, BL)
    assert message
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(**{knob: bad}).resolve(llm.engine.cfg.decoding, 16)
    assert err.value.param == knob and str(err.value) == message
    cfg = compose("generate", [f"decoding.block_length={BL}", f"decoding.{knob}={bad}"])
    with pytest.raises(ConfigError) as cerr:
        validate_config(cfg, cuda_available=False)
    assert str(cerr.value).startswith(f"decoding.{knob}=")
    with pytest.raises(ValueError, match=knob):
        reference_generate(llm.engine.model, [1, 2, 3], mask_id=llm.engine.mask_id, eos_id=llm.engine.eos_id,
                           block_length=BL, **{knob: bad})


def test_registry_lists_every_decoder_the_config_accepts():
    from fluxlab.config import ConfigError, compose, validate_config

    from fluxlab.models.registry import FAMILY_DECODERS, owner_of

    for name in DECODERS:  # a family's own decoder runs on that family's models (canvas: Diffusion-Gemma's)
        model = [f"model={owner_of(name).group}"] if name in FAMILY_DECODERS else []
        validate_config(compose("generate", [f"decoding.decoder={name}"] + model), cuda_available=False)
    with pytest.raises(ConfigError, match=", ".join(DECODERS)):
        validate_config(compose("generate", ["decoding.decoder=nosuch"]), cuda_available=False)


@pytest.mark.parametrize("seed", [2**63, 2**64, -2**63 - 1, 2**80])
def test_seeds_beyond_int64_are_refused_at_admission(llm, seed):
    with pytest.raises(InvalidRequest) as err:
        llm.engine.add_request([1, 2, 3], SamplingParams(seed=seed, temperature=1.0))
    assert err.value.param == "seed"
    assert not llm.engine.has_unfinished()


def test_a_failing_row_fails_alone_and_the_others_match_the_reference(llm, monkeypatch):
    engine = llm.engine
    runner = engine.runner
    batch = prompts(llm, [9, 20, 31], seed=13)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in batch]
    victim = engine.requests[ids[1]]
    original = runner._decode

    def failing_decode(inputs, *args, **kwargs):
        if victim in inputs.requests:
            raise RuntimeError("injected step failure")
        return original(inputs, *args, **kwargs)

    monkeypatch.setattr(runner, "_decode", failing_decode)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    monkeypatch.undo()
    assert done[ids[1]].finish_reason == "error" and "injected step failure" in done[ids[1]].error
    from test_engine import reference

    for i in (0, 2):
        assert done[ids[i]].token_ids == reference(llm, batch[i], params).token_ids
    assert engine.kv_free_pages == engine.kv_total_pages
    assert sorted(engine.scheduler.free_slots) == list(range(engine.cfg.scheduler.max_num_seqs))
    check_parity(llm, batch[:2], [params] * 2)  # the engine keeps working


@pytest.mark.parametrize("decoder", ["threshold", "joint_threshold"])
def test_logits_only_at_positions_a_decoder_may_write(llm, monkeypatch, decoder):
    """threshold: one logit row per masked position; an editing decoder: every non-prompt position."""
    engine = llm.engine
    runner = engine.runner
    seen = []
    original = runner.prepare_decode

    def recording_prepare(batch, inputs):
        decode_inputs = original(batch, inputs)
        if decode_inputs is not None:
            expected = 0
            for request in decode_inputs.requests:
                block = request.active_tokens
                editable = torch.arange(BL) >= request.prompt_positions_in_active_block()
                if DECODERS[request.params.decoder].edits:
                    expected += int(editable.sum())
                else:
                    expected += int(((torch.from_numpy(block.copy()) == engine.mask_id) & editable).sum())
            seen.append((inputs.logit_index.shape[0], expected))
        return decode_inputs

    monkeypatch.setattr(runner, "prepare_decode", recording_prepare)
    check_parity(llm, prompts(llm, [7, 20], seed=3), [SamplingParams(max_new_tokens=30, decoder=decoder)] * 2)
    assert seen and all(got == want for got, want in seen)
    if decoder == "threshold":
        assert any(got < 2 * BL for got, _ in seen)  # later steps compute fewer rows than the blocks hold


def test_step_state_is_written_only_on_admission_and_block_entry(llm, monkeypatch):
    engine = llm.engine
    state = engine.runner.step_state
    writes = []
    original = state.refresh

    def counting_refresh(requests, slots, owners):
        before = state.owner.copy()
        original(requests, slots, owners)
        writes.append(int((before != state.owner).any(axis=1).sum()))

    monkeypatch.setattr(state, "refresh", counting_refresh)
    [result] = check_parity(llm, prompts(llm, [5]), [SamplingParams(max_new_tokens=3 * BL, ignore_eos=True)])
    # one write per block the request decoded, none on the other steps
    assert sum(writes) == result.stats.blocks_committed
    assert writes.count(0) == result.stats.forwards - result.stats.blocks_committed


def test_postprocess_is_the_only_writer_of_request_progress(llm, monkeypatch):
    """Counters move only inside Scheduler.postprocess (and admission/preemption in schedule)."""
    import fluxlab.engine.sequence as sequence

    engine = llm.engine
    inside = {"postprocess": False}
    watched = ("active_block", "forwards_in_block", "output_ids", "num_cached_blocks")
    violations = []
    original_setattr = sequence.Request.__setattr__

    def guarded(self, name, value):
        if name in watched and hasattr(self, name) and not inside["postprocess"]:
            import traceback

            stack = "".join(traceback.format_stack(limit=6))
            if "schedule" not in stack and "_release" not in stack and "free" not in stack:
                violations.append((name, stack))
        original_setattr(self, name, value)

    original_post = engine.scheduler.postprocess

    def wrapped(batch, out):
        inside["postprocess"] = True
        try:
            return original_post(batch, out)
        finally:
            inside["postprocess"] = False

    # While seated, a request's progress lives in its seat's arrays (seats.py), written by numpy
    # calls, not attributes: the step's forward and decode (runner.run) must leave them untouched.
    from fluxlab.engine.seats import PROGRESS, UNFOLDED

    seats = engine.scheduler.seats
    names = ("tokens", "decoding", "state", "columns", "log_len", *PROGRESS, *UNFOLDED)
    def checked(method: str):
        original = getattr(engine.runner, method)

        def checked_call(*args, **kwargs):
            before = {name: getattr(seats, name).copy() for name in names}
            out = original(*args, **kwargs)
            for name in names:
                if not np.array_equal(before[name], getattr(seats, name)):
                    violations.append((name, f"runner.{method} changed seats.{name}"))
            return out
        return checked_call

    monkeypatch.setattr(sequence.Request, "__setattr__", guarded)
    monkeypatch.setattr(engine.scheduler, "postprocess", wrapped)
    for method in ("run", "launch", "finish"):  # (run without async scheduling, launch + finish with it)
        monkeypatch.setattr(engine.runner, method, checked(method))
    check_parity(llm, prompts(llm, [9, 30], seed=8), [SamplingParams(max_new_tokens=40)] * 2)
    assert not violations, violations[0][1]


def test_prefill_chunks_without_a_decoding_row_match_the_reference():
    """A prompt longer than the token budget runs forwards that decode nothing (the runner returns
    no step output); postprocess still caches their blocks."""
    budget_llm = engine_llm("scheduler.max_scheduled_tokens=32")
    check_parity(budget_llm, prompts(budget_llm, [3 * BL + 5, 9], seed=4), [SamplingParams(max_new_tokens=24)] * 2)


@pytest.mark.parametrize("rows,mode,want", [
    ([1, 1, 1], "padded", [(3, 4)]),
    ([2, 2, 1, 3], "padded", [(4, 8)]),
    ([2] * 8 + [1], "padded", None),  # 17 segments > 16
    ([1] * 5, "decomposed", [(4, 4), (1, 1)]),
    ([2, 2, 2, 1, 1, 1, 1, 1, 1], "decomposed", [(5, 8), (4, 4)]),
    ([9], "decomposed", [(1, 16)]),
    ([20], "decomposed", None),
])
def test_graph_plan_covers_any_mix_of_rows(rows, mode, want):
    assert plan_chunks(rows, [1, 2, 4, 8, 16], mode) == want


def test_random_weight_presets_never_read_tokenizer_files_of_the_working_directory(tmp_path, monkeypatch):
    """special_token_ids("") used to read ./tokenizer*.json; random real-preset weights take the
    released ids instead."""
    from fluxlab.models.llada2.presets import EOS_TOKEN_ID, MASK_TOKEN_ID
    from fluxlab.models.llada2.special_ids import special_token_ids

    (tmp_path / "tokenizer_config.json").write_text('{"mask_token": "<m>", "eos_token": "<e>"}')
    (tmp_path / "tokenizer.json").write_text('{"added_tokens": [{"content": "<m>", "id": 5}, '
                                             '{"content": "<e>", "id": 6}]}')
    monkeypatch.chdir(tmp_path)
    assert special_token_ids(tmp_path)[:2] == (5, 6)  # the files are readable...
    from fluxlab.llm import LLM

    random_llm = LLM(overrides=["model.preset=small", "model.load_format=random", "model.path=null",
                                "engine.device=cpu", "engine.dtype=float32", "decoding.block_length=16",
                                "model.max_model_len=64", "model.max_new_tokens=16", "scheduler.max_num_seqs=1",
                                "scheduler.max_scheduled_tokens=64", "engine.cpu_kv_cache_gb=0.05"])
    assert (random_llm.engine.mask_id, random_llm.engine.eos_id) == (MASK_TOKEN_ID, EOS_TOKEN_ID)


@pytest.mark.parametrize("trust", [True, False])
def test_trust_remote_code_reaches_the_tokenizer(tiny_ckpt, monkeypatch, trust):
    import transformers

    from fluxlab.engine.loading import load_tokenizer

    seen = {}
    original = transformers.AutoTokenizer.from_pretrained

    def recording(*args, **kwargs):
        seen.update(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", recording)
    load_tokenizer(tiny_ckpt, trust)
    assert seen["trust_remote_code"] is trust


def test_graph_sizes_cover_decode_commit_and_fdfo_mixes(gpu_packages):
    from fluxlab.config import compose, validate_config
    from fluxlab.engine.graph_runner import graph_segment_sizes

    def sizes(*overrides):
        cfg = compose("generate", ["engine.device=cuda", "attention=flashinfer", "decoding.block_length=32",
                                   "scheduler.max_num_seqs=16", *overrides])
        validate_config(cfg, cuda_available=True)
        return graph_segment_sizes(cfg)

    assert sizes("attention.use_decode_cuda_graph=true", "scheduler.max_scheduled_tokens=1024") == list(range(1, 33))
    assert sizes("attention.use_decode_cuda_graph=true", "scheduler.max_num_seqs=64", "scheduler.max_scheduled_tokens=4096") == \
        list(range(1, 33)) + list(range(34, 65, 2)) + list(range(68, 129, 4))
    # the token budget caps what a forward can hold
    assert sizes("attention.use_decode_cuda_graph=true", "scheduler.max_scheduled_tokens=512") == list(range(1, 17))
    assert sizes("attention.use_prefill_cuda_graph=true", "scheduler.max_scheduled_tokens=1024",
                 "attention.cuda_graph_capture_sizes=[64,128,256,512,1024]") == [2, 4, 8, 16, 32]
    assert sizes("scheduler.max_scheduled_tokens=1024") == []


def test_flashinfer_wrappers_of_a_runner_share_one_workspace(monkeypatch):
    """Eager and every graph's FlashInfer wrapper get the same float and int workspace (a fake
    flashinfer module records what the public API receives), each graph its own index buffers."""
    import sys
    import types

    from fluxlab.engine.model_runner import ModelRunner

    class FakeWrapper:
        def __init__(self, float_workspace_buffer, kv_layout, use_cuda_graph=False, **buffers):
            self.float_buffer, self.buffers, self.int_buffer = float_workspace_buffer, buffers, None

        def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffer):
            self.float_buffer, self.int_buffer = float_workspace_buffer, int_workspace_buffer

    monkeypatch.setitem(sys.modules, "flashinfer",
                        types.SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=FakeWrapper))
    config = types.SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_hidden_layers=2)
    model = types.SimpleNamespace(config=config)
    runner = ModelRunner(model, num_pages=8, block_length=4, device=torch.device("cpu"), dtype=torch.float32,
                         backend="flashinfer", max_blocks_per_seq=4, max_num_seqs=2)
    backends = [runner.attention] + [runner._make_backend("flashinfer", graph_segments=n) for n in (1, 4, 8)]
    wrappers = [b.wrapper for b in backends]
    assert len({id(w.float_buffer) for w in wrappers}) == 1 and len({id(w.int_buffer) for w in wrappers}) == 1
    assert wrappers[0].float_buffer is runner._flashinfer_workspace.float_buffer
    assert wrappers[0].int_buffer is runner._flashinfer_workspace.int_buffer
    assert [w.buffers["paged_kv_indptr_buf"].shape[0] for w in wrappers[1:]] == [2, 5, 9]
    assert len({id(w.buffers["paged_kv_indices_buf"]) for w in wrappers[1:]}) == 3


def test_block_routed_model_runs_in_the_engine_and_matches_the_reference():
    """LLaDA2.2's block routing is a model rule whatever the decoder: tiny_llada22 under the
    threshold decoder, a mixed batch on the dynamic policy, equals the reference per request."""
    from fluxlab.models.llada2.reference import reference_generate
    from fluxlab.llm import LLM

    llm = LLM(model="tiny_llada22", overrides=["engine.dtype=float32", "engine.device=cpu", "scheduler=dynamic",
                                               "decoding.block_length=16", "model.max_model_len=256",
                                               "scheduler.max_num_seqs=4", "scheduler.max_scheduled_tokens=128"])
    engine = llm.engine
    assert engine.model_config.routing_block_size and 16 % engine.model_config.routing_block_size == 0
    batch = prompts(llm, [5, 16, 23, 40], seed=17)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    results = llm.generate(batch, params)
    for prompt, got in zip(batch, results):
        want = reference_generate(engine.model, prompt, mask_id=engine.mask_id, eos_id=engine.eos_id,
                                  block_length=16, max_new_tokens=30, ignore_eos=True, steps=16)
        # the threshold decoder may accept LLaDA2.2's edit tokens: they are never emitted
        assert got.token_ids == [t for t in want.token_ids if t not in engine.hidden_ids]
    assert engine.kv_free_pages == engine.kv_total_pages


def test_misaligned_rows_never_reach_a_block_routed_moe(llm):
    from fluxlab.engine.layers.moe import check_routing_blocks

    with pytest.raises(ValueError, match="routing block"):
        check_routing_blocks(list(range(16)) + list(range(16)), 32)  # two 16-token rows fill one block of 32


@pytest.mark.parametrize("policy", ["paged", "dynamic"])
def test_a_repeated_schedule_gives_the_rows_a_full_schedule_gives(policy, monkeypatch):
    """After a step where no row finished its block, schedule reuses the last batch's rows; the
    full placement must give the same rows in every step, and the same tokens."""
    from fluxlab.engine.scheduler import Scheduler

    def run(memo: bool):
        llm = engine_llm(f"scheduler={policy}", "scheduler.enable_prefix_cache=false")  # both runs start cold
        scheduler = llm.engine.scheduler
        batches, seen, reused = [], {}, []
        original = scheduler.schedule

        def recording_schedule(*args, **kwargs):
            reused.append(scheduler._repeat is not None)
            batch = original(*args, **kwargs)
            order = [seen.setdefault(r.serial, len(seen)) for r in batch.requests]  # requests by arrival
            batches.append((order, batch.first_block.tolist(), batch.num_blocks.tolist(), batch.decodes.tolist()))
            return batch

        with monkeypatch.context() as m:
            m.setattr(scheduler, "schedule", recording_schedule)
            if not memo:
                m.setattr(Scheduler, "_repeat", property(lambda self: None, lambda self, value: None), raising=False)
            results = llm.generate(prompts(llm, [5, 18, 33, 9], seed=21), [SamplingParams(max_new_tokens=40)] * 4)
        return [r.token_ids for r in results], batches, sum(reused), reused

    with_memo, without_memo = run(True), run(False)
    assert with_memo[2] > 0 and without_memo[2] == 0  # the memo was used, and only in the first run
    assert with_memo[0] == without_memo[0]
    assert with_memo[1] == without_memo[1]
    # the memo also follows a step of commit + decode rows (the block after a commit, alone)
    batches, reused = with_memo[1], with_memo[3]
    assert any(reused[i + 1] and max(batches[i][2]) == 2 and all(batches[i][3]) for i in range(len(batches) - 1))
    # and (paged) a step whose rows came in another order than their arrival (they met at a barrier)
    assert policy == "dynamic" or any(reused[i + 1] and batches[i][0] != sorted(batches[i][0]) and all(batches[i][3])
               for i in range(len(batches) - 1))


def test_a_block_whose_last_forward_changed_nothing_needs_no_commit_segment(llm, monkeypatch):
    """An editing decoder ends a block on a forward that changes nothing; that forward wrote the
    block's K/V from its final tokens, so the next forward runs the next block alone (no commit
    segment), and the tokens and forwards still match the reference. editing_threshold=1.0 never
    edits, so every block ends that way."""
    rows = []
    original = llm.engine.scheduler.schedule

    def recording_schedule(*args, **kwargs):
        batch = original(*args, **kwargs)
        rows.extend(batch.num_blocks.tolist())
        return batch

    monkeypatch.setattr(llm.engine.scheduler, "schedule", recording_schedule)
    params = SamplingParams(max_new_tokens=3 * BL, decoder="joint_threshold", editing_threshold=1.0, ignore_eos=True)
    [result] = check_parity(llm, prompts(llm, [2 * BL], seed=6), [params])
    assert result.stats.blocks_committed == 3
    assert rows[0] == 3 and rows[1:] and set(rows[1:]) == {1}  # two prompt blocks + the active one, then one block a row


def test_flashinfer_segments_plan_each_query_block_over_its_prefix_pages():
    """A row of n query blocks from block f is n segments; segment f+i attends pages 0..f+i."""
    from fluxlab.engine.layers.attention_flashinfer import plan_indices
    from fluxlab.engine.layers.segments import Segments

    rows = [(2, 1, [7, 8, 9]), (0, 2, [4, 5]), (1, 2, [1, 2, 3])]
    qo, kv_indptr, kv_indices = plan_indices(Segments.of_rows(rows), 16)
    assert qo.tolist() == [0, 16, 32, 48, 64, 80]
    assert kv_indptr.tolist() == [0, 3, 4, 6, 8, 11]
    assert kv_indices.tolist() == [7, 8, 9, 4, 4, 5, 1, 2, 1, 2, 3]
    assert qo.dtype == kv_indptr.dtype == kv_indices.dtype == np.int32


def test_extend_gives_the_pages_one_allocate_per_request_gives():
    """Schedule grows the running rows' tables in one call: the same pages, in row order, and the
    seats' mirror as allocate writes it."""
    from fluxlab.engine.block_manager import BlockManager
    from fluxlab.engine.sequence import Request

    def setup():
        manager = BlockManager(12, enable_prefix_cache=True, num_seats=3, max_blocks_per_seq=6)
        requests = [Request(f"r{i}", list(range(1, 2 + 5 * i)), SamplingParams(max_new_tokens=16), 4, 0, (99,))
                    for i in range(3)]
        for seat, request in enumerate(requests):
            request.slot = seat
            manager.allocate(request, 1 + seat)
        return manager, requests

    one, by_row = setup()
    batched, rows = setup()
    want = [3, 4, 5]
    for request, n in zip(by_row, want):
        one.allocate(request, n)
    batched.extend(rows, want)
    assert [r.page_table for r in rows] == [r.page_table for r in by_row]
    assert np.array_equal(batched.seat_pages, one.seat_pages)
    assert np.array_equal(batched.seat_num_pages, one.seat_num_pages) and batched.seat_num_pages.tolist() == want


def test_cache_rows_enters_what_cache_blocks_per_row_enters():
    """A commit step enters its rows' blocks in one call: the same entries, page switches (two rows
    committing the same block in one forward) and freed pages as cache_blocks row by row, a
    multi-block row (a prefill chunk) included."""
    from fluxlab.engine.block_manager import BlockManager
    from fluxlab.engine.sequence import Request

    prompt = list(range(1, 13))  # three blocks of 4
    def setup():
        manager = BlockManager(20, enable_prefix_cache=True, num_seats=3, max_blocks_per_seq=6)
        requests = [Request(f"r{i}", prompt if i < 2 else prompt[::-1], SamplingParams(max_new_tokens=8), 4, 0, (99,))
                    for i in range(3)]
        for seat, request in enumerate(requests):
            request.slot = seat
            manager.allocate(request, 3)
        return manager, requests

    rows = [(0, 1), (0, 1), (0, 3)]  # r0 and r1 commit the same block 0; r2 three blocks
    one, by_row = setup()
    for request, (first, end) in zip(by_row, rows):
        one.cache_blocks(request, first, end)
    batched, requests = setup()
    first_tokens = np.stack([r.tokens[f * 4:(f + 1) * 4] for r, (f, _) in zip(requests, rows)])
    batched.cache_rows(requests, [f for f, _ in rows], [e for _, e in rows], first_tokens)
    assert [r.page_table for r in requests] == [r.page_table for r in by_row]
    assert requests[1].page_table[0] == requests[0].page_table[0]  # switched to r0's page
    assert {k: (e.page, e.refs) for k, e in batched.cached.items()} == {k: (e.page, e.refs) for k, e in one.cached.items()}
    assert list(batched.free_pages) == list(one.free_pages) and np.array_equal(batched.seat_pages, one.seat_pages)
    batched.check(requests)
