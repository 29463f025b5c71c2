"""Bench metrics on synthetic timings, with the values worked out by hand (sglang bench_serving definitions)."""
from __future__ import annotations

import pytest

from fluxlab.bench.metrics import RequestRecord, compute_metrics, records_frame


def records():
    return [
        RequestRecord(index=0, success=True, prompt_tokens=10, output_tokens=5, ttft_s=0.1, e2e_s=0.5,
                      itl_s=[0.2, 0.2], chunks=3, forwards=4, tokens_accepted=8, correct=True),
        RequestRecord(index=1, success=True, prompt_tokens=20, output_tokens=1, ttft_s=0.3, e2e_s=0.3,
                      chunks=1, forwards=2, tokens_accepted=2, correct=False),
        RequestRecord(index=2, success=False, error="HTTP 503", prompt_tokens=99, output_tokens=99, e2e_s=9.0),
    ]


def test_counts_and_throughputs_use_completed_requests_only():
    m = compute_metrics(records(), duration_s=1.0)
    assert (m["completed"], m["failed"]) == (2, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (30, 6)
    assert m["request_throughput"] == pytest.approx(2.0)
    assert m["output_throughput"] == pytest.approx(6.0)
    assert m["total_throughput"] == pytest.approx(36.0)
    assert m["duration"] == 1.0


def test_latency_percentiles_in_ms():
    m = compute_metrics(records(), duration_s=1.0)
    assert m["mean_e2e_latency_ms"] == pytest.approx(400.0)
    assert m["median_e2e_latency_ms"] == pytest.approx(400.0)
    assert m["std_e2e_latency_ms"] == pytest.approx(100.0)  # population std, as numpy / sglang
    assert m["p90_e2e_latency_ms"] == pytest.approx(480.0)  # linear interpolation between 300 and 500
    assert m["p95_e2e_latency_ms"] == pytest.approx(490.0)
    assert m["p99_e2e_latency_ms"] == pytest.approx(498.0)
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["p99_ttft_ms"] == pytest.approx(298.0)


def test_tpot_is_decode_time_over_tokens_after_the_first():
    m = compute_metrics(records(), duration_s=1.0)
    # (0.5 - 0.1) / (5 - 1) = 100 ms; the one-token request has no TPOT.
    assert m["mean_tpot_ms"] == pytest.approx(100.0)
    assert m["std_tpot_ms"] == pytest.approx(0.0)
    assert records()[1].tpot_s is None


def test_itl_is_every_gap_between_chunks():
    m = compute_metrics(records(), duration_s=1.0)
    assert m["mean_itl_ms"] == pytest.approx(200.0) and m["p99_itl_ms"] == pytest.approx(200.0)


def test_concurrency_tpf_tokens_per_chunk_and_accuracy():
    m = compute_metrics(records(), duration_s=2.0)
    assert m["concurrency"] == pytest.approx(0.8 / 2.0)  # sum of e2e / duration
    assert m["forwards"] == 6
    assert m["tokens_per_forward"] == pytest.approx(10 / 6)  # accepted tokens / forwards
    assert m["tokens_per_chunk"] == pytest.approx(6 / 4)
    assert m["accuracy"] == pytest.approx(0.5)


def test_tpf_falls_back_to_output_tokens_without_accepted_counts():
    rs = [RequestRecord(index=0, success=True, output_tokens=12, forwards=4, e2e_s=1.0)]
    assert compute_metrics(rs, 1.0)["tokens_per_forward"] == pytest.approx(3.0)


def test_tokens_edited_sums_completed_requests_and_is_absent_when_unreported():
    rs = records()
    rs[0].tokens_edited, rs[1].tokens_edited, rs[2].tokens_edited = 3, 0, 50  # rs[2] failed
    assert compute_metrics(rs, 1.0)["tokens_edited"] == 3
    assert "tokens_edited" not in compute_metrics(records(), 1.0)  # e.g. a server without the count


def test_no_completed_request_gives_zeros_and_no_accuracy():
    m = compute_metrics([RequestRecord(index=0, error="boom")], duration_s=1.0)
    assert m["completed"] == 0 and m["failed"] == 1
    assert m["mean_ttft_ms"] == 0.0 and m["p99_itl_ms"] == 0.0 and m["tokens_per_forward"] == 0.0
    assert "accuracy" not in m


def test_per_request_frame_has_one_row_per_request():
    frame = records_frame(records())
    assert list(frame["index"]) == [0, 1, 2]
    assert frame.loc[0, "itl_s"] == "0.200000 0.200000"
    assert frame.loc[0, "tpot_s"] == pytest.approx(0.1)


def test_engine_step_counters_give_step_host_and_graph_shares():
    from fluxlab.bench.metrics import EngineSteps

    records = [RequestRecord(index=0, prompt_tokens=4, output_tokens=8, success=True, e2e_s=1.0, ttft_s=0.5)]
    m = compute_metrics(records, 1.0, EngineSteps(forwards=10, seconds=0.2, graph_forwards=9, host_seconds=0.05))
    assert m["engine_steps"] == 10 and m["mean_step_ms"] == pytest.approx(20.0)
    assert m["graph_share"] == pytest.approx(0.9) and m["mean_host_ms"] == pytest.approx(5.0)
    assert "mean_host_ms" not in compute_metrics(records, 1.0, EngineSteps(forwards=10, seconds=0.2))


def test_a_released_offline_engine_is_garbage_collected():
    """bench keeps one engine across a sweep's jobs; the next one sizes its KV cache from the
    device's free memory, so the released engine must not stay reachable."""
    import weakref

    from fluxlab.bench import offline
    from fluxlab.config import compose, validate_config

    cfg = compose("bench", ["model=tiny_llada2", "engine.device=cpu", "bench=offline"])
    validate_config(cfg)
    llm, reused = offline.acquire_llm(cfg)
    assert not reused and offline.acquire_llm(cfg) == (llm, True)
    engine = weakref.ref(llm.engine)
    del llm
    offline.release_llm()
    assert engine() is None
