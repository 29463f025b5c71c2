"""Per-request records and the run's metrics, named as sglang's bench_serving names them.

Definitions (DESIGN §10), over the requests that completed:
  request/output/total_throughput = completed, output tokens, input+output tokens per second of duration
  ttft = first streamed chunk (a committed block) after the request was sent
  tpot = (e2e - ttft) / (output_tokens - 1), for requests with more than one output token
  itl  = every gap between consecutive chunks of a request (a chunk is a block, so ITL is per block)
  concurrency = sum of e2e latencies / duration (the average number of requests in flight)
  tokens_per_forward = tokens the decoder accepted / forwards of the requests' active blocks
  tokens_edited = committed tokens an editing decoder rewrote (token -> token), summed over requests;
    absent when no request reported it (the server's usage does not carry it yet)
  tokens_per_chunk = output tokens / chunks
  correct, scored = scored requests answered right / scored requests; accuracy = correct / scored
  engine_steps, mean_step_ms = the engine's forwards during the timed run and their mean wall time
    (schedule + forward + decode), from the engine's counters (offline) or the server's /metrics
  graph_share = the share of those forwards that replayed a CUDA graph
  cached_token_share = prompt tokens served from the prefix cache / input tokens (usage's
    prompt_tokens_details.cached_tokens)
Percentiles use numpy's linear interpolation, as sglang does; an empty sample gives 0, as there.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

import numpy as np
import pandas as pd

STATS = ("mean", "median", "std", "p90", "p95", "p99")
LATENCIES = ("e2e_latency", "ttft", "tpot", "itl")
HEADLINE = ("completed", "failed", "duration", "request_throughput", "output_throughput", "tokens_per_forward",
            "tokens_edited",
            "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "mean_itl_ms", "p99_e2e_latency_ms",
            "mean_step_ms", "graph_share", "cached_token_share", "accuracy")


@dataclass
class RequestRecord:
    index: int
    success: bool = False
    error: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    output_tokens: int = 0  # from the engine / the server's usage, never re-tokenised
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    chunks: int = 0  # streamed pieces that carried tokens
    forwards: Optional[int] = None
    tokens_accepted: Optional[int] = None  # null -> output_tokens stands in for TPF
    tokens_edited: Optional[int] = None  # token -> token edits; null: not reported
    finish_reason: Optional[str] = None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)  # output ids: the report's token agreement (bench/compare.py)
    answer: Optional[str] = None
    correct: Optional[bool] = None

    @property
    def tpot_s(self) -> Optional[float]:
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def _stats(name: str, values_s: Sequence[float]) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=float) * 1e3
    if ms.size == 0:
        return {f"{stat}_{name}_ms": 0.0 for stat in STATS}
    return {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
            f"std_{name}_ms": float(ms.std()), f"p90_{name}_ms": float(np.percentile(ms, 90)),
            f"p95_{name}_ms": float(np.percentile(ms, 95)), f"p99_{name}_ms": float(np.percentile(ms, 99))}


@dataclass
class EngineSteps:
    """The engine's step counters during a timed run (differences of its monotonic totals)."""

    forwards: int
    seconds: float
    graph_forwards: Optional[int] = None  # of those, CUDA graph replays (None: not reported)
    host_seconds: Optional[float] = None  # of `seconds`, host work the GPU waited for (None: not reported)


def compute_metrics(records: Sequence[RequestRecord], duration_s: float,
                    steps: Optional[EngineSteps] = None) -> dict[str, float]:
    """The run's metrics from its per-request records and wall-clock duration (first send to last
    answer), plus the engine's step latency when its counters could be read."""
    done = [r for r in records if r.success]
    total_in = sum(r.prompt_tokens for r in done)
    total_out = sum(r.output_tokens for r in done)
    duration = max(duration_s, 1e-9)
    metrics: dict[str, float] = {
        "duration": duration_s, "completed": len(done), "failed": len(records) - len(done),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(done) / duration, "output_throughput": total_out / duration,
        "total_throughput": (total_in + total_out) / duration,
    }
    metrics.update(_stats("e2e_latency", [r.e2e_s for r in done]))
    metrics.update(_stats("ttft", [r.ttft_s for r in done]))
    metrics.update(_stats("tpot", [r.tpot_s for r in done if r.tpot_s is not None]))
    metrics.update(_stats("itl", [gap for r in done for gap in r.itl_s]))
    metrics["concurrency"] = sum(r.e2e_s for r in done) / duration

    counted = [r for r in done if r.forwards]
    forwards = sum(r.forwards for r in counted)
    accepted = sum(r.tokens_accepted if r.tokens_accepted is not None else r.output_tokens for r in counted)
    metrics["forwards"] = forwards
    metrics["tokens_per_forward"] = accepted / forwards if forwards else 0.0
    edited = [r.tokens_edited for r in done if r.tokens_edited is not None]
    if edited:
        metrics["tokens_edited"] = sum(edited)
    metrics["cached_token_share"] = sum(r.cached_tokens for r in done) / total_in if total_in else 0.0
    chunks = sum(r.chunks for r in done)
    metrics["tokens_per_chunk"] = total_out / chunks if chunks else 0.0
    scored = [r.correct for r in done if r.correct is not None]
    if scored:
        metrics["correct"], metrics["scored"] = sum(scored), len(scored)
        metrics["accuracy"] = sum(scored) / len(scored)
    if steps is not None and steps.forwards > 0:
        metrics["engine_steps"] = steps.forwards
        metrics["mean_step_ms"] = 1e3 * steps.seconds / steps.forwards
        if steps.graph_forwards is not None:
            metrics["graph_share"] = steps.graph_forwards / steps.forwards
        if steps.host_seconds is not None:
            metrics["mean_host_ms"] = 1e3 * steps.host_seconds / steps.forwards
    return metrics


def records_frame(records: Sequence[RequestRecord]) -> pd.DataFrame:
    """One row per request, for the per-request CSV (ITLs as a space-separated list of seconds, output
    token ids as a space-separated list)."""
    rows = []
    for r in records:
        row = asdict(r)
        row["tpot_s"] = r.tpot_s
        row["itl_s"] = " ".join(f"{gap:.6f}" for gap in r.itl_s)
        row["token_ids"] = " ".join(map(str, r.token_ids))
        rows.append(row)
    return pd.DataFrame(rows)
