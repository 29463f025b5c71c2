"""Offline load: every prompt into the in-process engine at once, stepped to completion.

The engine is driven step by step (not `llm.generate`) so each request's committed blocks are timed
as they come out, giving TTFT and per-block ITL on the same definitions as the streamed online
client. Like the online server, the engine is kept across the jobs of a sweep while only
per-request keys change (they travel in SamplingParams).
"""
from __future__ import annotations

import atexit
import gc
import time
from typing import Any, Optional, Sequence

import torch
from omegaconf import DictConfig
from tqdm.auto import tqdm

from fluxlab.bench.metrics import EngineSteps, RequestRecord
from fluxlab.bench.server_process import server_overrides
from fluxlab.bench.workload import BenchPrompt

_llm: Any = None
_llm_key: Optional[list[str]] = None


def acquire_llm(cfg: DictConfig) -> tuple[Any, bool]:
    """(an LLM for `cfg`, reused): the previous job's engine when only per-request keys differ."""
    global _llm, _llm_key
    key = server_overrides(cfg)
    if _llm is not None and _llm_key == key:
        return _llm, True
    release_llm()
    from fluxlab.llm import LLM

    _llm, _llm_key = LLM.from_config(cfg), key
    return _llm, False


def release_llm() -> None:
    """Shut the kept engine down and give its GPU memory back: the next job's engine sizes its KV
    cache from the device's free memory, which the caching allocator's blocks would still hold."""
    global _llm, _llm_key
    if _llm is None:
        return
    _llm.shutdown()
    _llm, _llm_key = None, None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


atexit.register(release_llm)  # TP workers of a kept engine must not outlive bench


def encode(llm: Any, prompt: BenchPrompt) -> list[int]:
    """Prompt token ids, built as the server builds them (the tokenizer's chat template for messages)."""
    if prompt.token_ids is not None:
        return list(prompt.token_ids)
    return llm.encode(prompt.messages)


def _params(prompt: BenchPrompt, knobs: dict[str, Any]) -> Any:
    from fluxlab.engine.request import SamplingParams

    grammar = None
    if prompt.response_format is not None:
        from fluxlab.engine.constraint import grammar_of_response_format

        grammar = grammar_of_response_format(prompt.response_format)
    return SamplingParams(max_new_tokens=prompt.max_tokens, ignore_eos=prompt.ignore_eos, grammar=grammar, **knobs)


def run_offline(llm: Any, prompts: Sequence[BenchPrompt], knobs: dict[str, Any], warmup_requests: int = 1,
                disable_progress: bool = False) -> tuple[list[RequestRecord], float, EngineSteps]:
    """Run every prompt through `llm.engine`; (records in prompt order, duration s, engine steps)."""
    engine = llm.engine
    prompt_ids = [encode(llm, p) for p in prompts]
    if warmup_requests:
        warm = [prompt_ids[i % len(prompts)] for i in range(warmup_requests)]
        llm.generate(warm, [_params(prompts[i % len(prompts)], knobs) for i in range(warmup_requests)])

    records: dict[str, RequestRecord] = {}
    sent: dict[str, float] = {}
    chunk_times: dict[str, list[float]] = {}
    forwards, step_seconds, host_seconds = engine.total_forwards, engine.total_step_seconds, engine.total_host_seconds
    graph_forwards = engine.runner.num_graph_forwards
    start = time.perf_counter()
    for prompt, ids in zip(prompts, prompt_ids):
        request_id = engine.add_request(ids, _params(prompt, knobs))
        sent[request_id] = time.perf_counter()
        chunk_times[request_id] = []
        records[request_id] = RequestRecord(index=prompt.index, answer=prompt.answer, prompt_tokens=len(ids))
    with tqdm(total=len(prompts), desc="requests", unit="req", disable=disable_progress) as progress:
        while engine.has_unfinished():
            outputs = engine.step()
            now = time.perf_counter()
            for out in outputs:
                if out.request_id not in records:
                    continue
                if out.new_token_ids:
                    chunk_times[out.request_id].append(now)
                if out.finished:
                    _finish(llm, records[out.request_id], out, sent[out.request_id], chunk_times[out.request_id], now)
                    progress.update(1)
    duration = time.perf_counter() - start
    steps = EngineSteps(engine.total_forwards - forwards, engine.total_step_seconds - step_seconds,
                        engine.runner.num_graph_forwards - graph_forwards, engine.total_host_seconds - host_seconds)
    return sorted(records.values(), key=lambda r: r.index), duration, steps


def _finish(llm: Any, record: RequestRecord, out: Any, sent: float, chunk_times: list[float], now: float) -> None:
    record.success = out.finish_reason != "abort"
    record.error = "" if record.success else "aborted by the engine"
    record.finish_reason = out.finish_reason
    record.output_tokens = len(out.token_ids)
    record.token_ids = list(out.token_ids)
    record.text = out.text if out.text is not None else llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    record.forwards = out.stats.forwards
    record.cached_tokens = out.stats.cached_tokens
    record.tokens_accepted = out.stats.tokens_accepted
    record.tokens_edited = out.stats.tokens_edited
    record.e2e_s = now - sent
    record.ttft_s = (chunk_times[0] if chunk_times else now) - sent
    record.itl_s = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
    record.chunks = len(chunk_times)
