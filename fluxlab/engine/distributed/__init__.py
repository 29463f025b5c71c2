"""Tensor/expert parallelism over local worker processes (DESIGN §7).

Rank 0 is the engine process itself: it schedules, decodes and sends each step's inputs
(`StepInputs`, host data) to tp_size - 1 worker processes (`python -m
fluxlab.engine.distributed.worker`) on a pipe each; every rank then runs the same forward (and the
same CUDA graphs) on its shard, joined by the model's own collectives (NCCL on GPU, gloo on CPU);
greedy positions send only per-shard vocabulary statistics to rank 0. See engine.py (rank 0),
worker.py (ranks 1..tp-1) and process.py (how a worker is started).
"""
