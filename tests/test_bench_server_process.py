"""Which sweep points share a started server, and how a single bench run fails."""
from __future__ import annotations

import json

import pytest

from fluxlab.bench import server_process
from fluxlab.bench.run import run_bench
from fluxlab.config import compose, validate_config


def cfg(*overrides):
    c = compose("bench", ["bench=online", *overrides])
    validate_config(c, cuda_available=False)
    return c


class FakeServer:
    started = 0

    def __init__(self, overrides, log_path, timeout_s):
        FakeServer.started += 1
        self.overrides, self.stopped = overrides, False

    def alive(self):
        return not self.stopped

    def stop(self):
        self.stopped = True


def test_per_request_keys_do_not_change_the_server_key():
    base = server_process.server_overrides(cfg())
    for key, value in [("threshold", 0.5), ("steps", 8), ("editing_threshold", 0.1), ("low_threshold", 0.1),
                       ("max_post_steps", 2), ("temperature", 0.7), ("top_p", 0.9), ("top_k", 5)]:
        assert server_process.server_overrides(cfg(f"decoding.{key}={value}")) == base, key
    assert server_process.server_overrides(cfg("workload.num_prompts=3", "bench.request_rate=2")) == base
    for other in ("decoding.block_length=32", "scheduler.max_num_seqs=4", "engine.dtype=float32", "decoding=hierarchy"):
        assert server_process.server_overrides(cfg(other)) != base, other
    assert "engine.dtype='bfloat16'" in base and not any(o.startswith("decoding.threshold=") for o in base)


def test_the_started_server_listens_on_server_port():
    assert "server.port=0" in server_process.server_overrides(cfg())  # bench's default: a free port
    pinned = server_process.server_overrides(cfg("server.port=9123"))
    assert "server.port=9123" in pinned and "server.port=0" not in pinned


def test_server_is_reused_for_per_request_keys_and_restarted_otherwise(monkeypatch, tmp_path):
    monkeypatch.setattr(server_process, "ServerProcess", FakeServer)
    monkeypatch.setattr(server_process, "_current", None)
    FakeServer.started = 0
    first, reused = server_process.acquire_server(cfg("decoding.threshold=0.7"), tmp_path / "a.log")
    assert not reused
    second, reused = server_process.acquire_server(cfg("decoding.threshold=0.9"), tmp_path / "b.log")
    assert reused and second is first and FakeServer.started == 1
    third, reused = server_process.acquire_server(cfg("decoding.block_length=32"), tmp_path / "c.log")
    assert not reused and first.stopped and FakeServer.started == 2
    server_process.stop_server()
    assert third.stopped and server_process._current is None


def test_single_run_failure_is_raised_and_recorded(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="workload.num_prompts=0"):
        run_bench(cfg("workload.num_prompts=0", "tracking=none"))
    (line,) = (tmp_path / "results.jsonl").read_text().splitlines()
    result = json.loads(line)
    assert result["status"] == "failed" and "num_prompts" in result["error"]
    assert not (tmp_path / "mlruns").exists()  # tracking=none logs nothing to MLflow


def test_dry_run_prints_the_config_and_runs_nothing(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run_bench(cfg("bench.dry_run=true")) == {}
    assert json.loads(capsys.readouterr().out)["bench"]["mode"] == "online"
    assert not list(tmp_path.iterdir())
