"""A TP/EP worker process (ranks 1..tp_size-1): a model shard and its runner, nothing else.

It builds no tokenizer, scheduler or decoder: rank 0 owns requests. It runs the same model build,
KV profile and CUDA graph captures as rank 0 (so every collective happens in the same order on
every rank), reports ready, then executes each step it reads from the step channel (a per-step
difference in shared memory, step_channel.py) until rank 0 says stop. Started as `python -m
fluxlab.engine.distributed.worker` (process.py says why not multiprocessing spawn).
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from fluxlab.engine.layers.linear import ParallelDims, set_parallel_dims
from fluxlab.engine.kv_budget import KVBudget
from fluxlab.engine.llm_engine import LLMEngine

log = logging.getLogger("fluxlab.engine")

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
    if not dist.is_initialized():
        # An earlier start in this process that failed part-way (a rank died during startup) advanced
        # torch's group counter without a destroy to reset it: this rank would name the default group
        # "1" while fresh workers name it "0", and the rendezvous would wait on keys nobody writes.
        dist.distributed_c10d._world.group_count = 0
    dist.init_process_group(par.distributed_backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=par.tp_size, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout)
    set_parallel_dims(ParallelDims(rank, par.tp_size, par.ep_size, dp_attention=bool(par.enable_dp_attention)))
    return control


class MinPagesOverRanks:
    """Every rank profiles its own memory; the KV page count is the minimum over the ranks."""

    _control = None  # the gloo control group

    def _profile_num_pages(self, free_at_start: int) -> int:
        pages = torch.tensor([super()._profile_num_pages(free_at_start)], dtype=torch.long)
        dist.all_reduce(pages, op=dist.ReduceOp.MIN, group=self._control)
        return int(pages.item())


class RankEngine(MinPagesOverRanks, LLMEngine):
    """Rank 0: the whole LLMEngine (tokenizer, scheduler, decoder) on its shard."""

    def __init__(self, cfg, control):
        self._control = control
        super().__init__(cfg)


class WorkerEngine(MinPagesOverRanks, KVBudget):
    """A TP/EP worker: its model shard, KV pages and runner, and no scheduler or tokenizer. Rank 0
    computed the special ids (`special`) before starting it."""

    def __init__(self, cfg, control, special):
        from fluxlab.engine.graph_runner import graph_segment_sizes
        from fluxlab.engine.loading import load_engine_model, resolve_model_dir
        from fluxlab.engine.model_runner import ModelRunner

        self._init_device(cfg)
        self._control, self.special = control, special
        self.mask_id = special.mask_id
        free_at_start = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else 0
        self.model, self.model_config = load_engine_model(cfg, self.device, self.dtype, resolve_model_dir(cfg.model))
        self.block_length = cfg.decoding.block_length
        self.max_model_len = cfg.model.max_model_len
        pages_per_seq = self.max_model_len // self.block_length
        num_pages = self._num_kv_pages(free_at_start)
        if cfg.engine.kv_cache_layout == "dense":  # whole slots, as the block manager keeps them
            num_pages -= num_pages % pages_per_seq
        self.runner = ModelRunner(self.model, num_pages, self.block_length, self.device, self.dtype,
                                  cfg.attention.backend, pages_per_seq, cfg.scheduler.max_num_seqs, self.mask_id,
                                  kv_cache_dtype=cfg.model.kv_cache_dtype)
        segment_sizes = graph_segment_sizes(cfg)
        if segment_sizes:
            self.runner.capture_graphs(segment_sizes, cfg.attention.cuda_graph_decode_mode)


def worker_main(payload: dict, messages, steps, shared_fd: int) -> None:
    """Process body: build, report ("ready" | "error", rank, traceback) on `messages` (a
    Connection), serve steps from the step channel until rank 0 says stop."""
    from omegaconf import OmegaConf

    from fluxlab.engine.distributed.dp_attention import run_rank_part
    from fluxlab.engine.distributed.step_channel import StepReader
    from fluxlab.engine.special_ids import SpecialIds

    rank = payload["rank"]
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s tp-rank{rank} %(levelname)s %(message)s")
    # Ctrl-C reaches the whole process group; rank 0 alone decides when the workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if os.environ.get("FLUXLAB_FAIL_RANK") == str(rank):  # fault injection for tests/test_parallel.py
            raise RuntimeError(f"injected startup failure on rank {rank}")
        cfg = OmegaConf.create(payload["cfg"])
        cfg.engine.device = rank_device(cfg.engine.device, rank)
        if cfg.engine.device == "cpu":
            # Ranks share the host's cores; one thread each avoids oversubscription.
            torch.set_num_threads(int(os.environ.get("FLUXLAB_WORKER_THREADS", "1")))
        channel = StepReader(shared_fd, steps, **payload["channel"])
        control = init_distributed(cfg, rank, payload["port"])
        engine = WorkerEngine(cfg, control, SpecialIds(**payload["special"]))
        dp_attention = bool(cfg.parallel.enable_dp_attention)
        if dp_attention:  # rank 0 numbers every rank's pages in one range; this rank's come at rank * N
            channel.page_offset = rank * engine.runner.scratch_page
        messages.send(("ready", rank, None))
    except BaseException:  # noqa: BLE001 - report to rank 0, whatever it is
        messages.send(("error", rank, traceback.format_exc()))
        sys.exit(1)
    try:
        while True:
            step = channel.receive()  # EOFError when rank 0 is gone
            if step is None:
                break
            if dp_attention:
                run_rank_part(engine.runner, step[0], step[1], cfg.parallel.tp_size)
            else:
                engine.runner.execute(step[0])
    except BaseException:  # noqa: BLE001
        messages.send(("error", rank, traceback.format_exc()))
        sys.exit(1)
    # No process-group teardown: rank 0 aborts its side, and a graceful NCCL destroy here can wait
    # forever on the peer. Exiting frees this rank's communicators and memory.
    engine.runner.release_graphs()
    channel.close()
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    from fluxlab.engine.distributed.process import read_payload

    worker_main(*read_payload())
