"""Tensor/expert parallelism over local worker processes (DESIGN §7).

Rank 0 is the engine process itself: it schedules and decodes; tp_size - 1 worker processes
(`python -m fluxlab.engine.distributed.worker`: a model shard and its runner, no tokenizer or
scheduler) keep each seat's page table and tokens and receive only each step's difference over
shared memory (step_channel.py). Every rank then runs the same forward (and the same CUDA graphs)
on its shard, joined by the model's own collectives (NCCL on GPU, gloo on CPU); greedy positions
send only per-shard vocabulary statistics to rank 0. With parallel.enable_dp_attention each rank
instead runs attention on its own requests and only the experts are split (dp_attention.py).
See engine.py (rank 0), worker.py (ranks 1..tp-1) and process.py (how a worker is started).
"""
