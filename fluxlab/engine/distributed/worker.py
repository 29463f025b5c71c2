"""A TP/EP worker process (ranks 1..tp_size-1): the same engine as rank 0, minus the scheduling.

It builds its model shard and runner through LLMEngine itself (same profiling forward, same KV
page count, same CUDA graph captures, so every collective happens in the same order on every
rank), reports ready, then executes each StepInputs rank 0 sends on its step pipe until it gets None. Started as `python -m fluxlab.engine.distributed.worker`
(process.py says why not multiprocessing spawn).
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from fluxlab.engine.layers.linear import ParallelDims, set_parallel_dims
from fluxlab.engine.llm_engine import LLMEngine

log = logging.getLogger("fluxlab.engine")

SHUTDOWN = None  # the step message that stops a worker


def rank_device(device: str, rank: int) -> str:
    """One device per rank: cuda:{base + rank} (base = the index in engine.device, else 0)."""
    if not device.startswith("cuda"):
        return device
    base = int(device.split(":")[1]) if ":" in device else 0
    return f"cuda:{base + rank}"


def init_distributed(cfg, rank: int, port: int):
    """Join the TP group (model collectives on parallel.distributed_backend) and return the gloo
    control group that carries the step messages (host data, also on GPU)."""
    par = cfg.parallel
    timeout = timedelta(seconds=float(par.startup_timeout_s))
    if par.distributed_backend == "nccl":
        torch.cuda.set_device(torch.device(cfg.engine.device))
    dist.init_process_group(par.distributed_backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=par.tp_size, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout)
    set_parallel_dims(ParallelDims(rank, par.tp_size, par.ep_size))
    return control


class RankEngine(LLMEngine):
    """LLMEngine of one TP rank: the KV page count is the minimum over the ranks' profiles."""

    def __init__(self, cfg, control):
        self._control = control
        super().__init__(cfg)

    def _profile_num_pages(self, free_at_start: int) -> int:
        pages = torch.tensor([super()._profile_num_pages(free_at_start)], dtype=torch.long)
        dist.all_reduce(pages, op=dist.ReduceOp.MIN, group=self._control)
        return int(pages.item())


def worker_main(cfg_container: dict, rank: int, port: int, messages, steps) -> None:
    """Process body: build, report ("ready" | "error", rank, traceback) on `messages` (a
    Connection), serve steps."""
    from omegaconf import OmegaConf

    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s tp-rank{rank} %(levelname)s %(message)s")
    # Ctrl-C reaches the whole process group; rank 0 alone decides when the workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if os.environ.get("FLUXLAB_FAIL_RANK") == str(rank):  # fault injection for tests/test_parallel.py
            raise RuntimeError(f"injected startup failure on rank {rank}")
        cfg = OmegaConf.create(cfg_container)
        cfg.engine.device = rank_device(cfg.engine.device, rank)
        if cfg.engine.device == "cpu":
            # Ranks share the host's cores; one thread each avoids oversubscription.
            torch.set_num_threads(int(os.environ.get("FLUXLAB_WORKER_THREADS", "1")))
        control = init_distributed(cfg, rank, port)
        engine = RankEngine(cfg, control)
        messages.send(("ready", rank, None))
    except BaseException:  # noqa: BLE001 - report to rank 0, whatever it is
        messages.send(("error", rank, traceback.format_exc()))
        sys.exit(1)
    try:
        while True:
            inputs = pickle.loads(steps.recv_bytes())  # EOFError when rank 0 is gone
            if inputs is SHUTDOWN:
                break
            engine.runner.execute(inputs)
    except BaseException:  # noqa: BLE001
        messages.send(("error", rank, traceback.format_exc()))
        sys.exit(1)
    # No process-group teardown: rank 0 aborts its side, and a graceful NCCL destroy here can wait
    # forever on the peer. Exiting frees this rank's communicators and memory.
    engine.runner.release_graphs()
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    from fluxlab.engine.distributed.process import read_payload

    _payload, _messages, _steps = read_payload()
    worker_main(_payload["cfg"], _payload["rank"], _payload["port"], _messages, _steps)
