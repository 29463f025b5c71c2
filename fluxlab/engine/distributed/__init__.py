"""Tensor/expert parallelism over local worker processes (DESIGN §7).

Rank 0 is the engine process itself: it schedules, decodes and broadcasts each step's inputs
(`StepInputs`, host data) to tp_size - 1 worker processes over a gloo control group; every rank
then runs the same forward (and the same CUDA graphs) on its shard, joined by the model's own
collectives (NCCL on GPU, gloo on CPU). See engine.py (rank 0) and worker.py (ranks 1..tp-1).
"""
