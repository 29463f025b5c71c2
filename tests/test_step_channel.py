"""The TP step channel (engine/distributed/step_channel.py): whatever the rows, seats, tables and
tokens of a step, a worker decodes exactly the StepInputs rank 0 encoded, from differences only."""
from __future__ import annotations

import os
from multiprocessing.connection import Connection

import numpy as np

from fluxlab.engine.distributed.step_channel import StepReader, StepWriter
from fluxlab.engine.runner_inputs import StepInputs

BL, MASK = 4, 99


def channel_pair():
    writer = StepWriter(num_seats=3, pages_per_seq=8, block_length=BL, max_tokens=64, mask_id=MASK)
    read_fd, write_fd = os.pipe()
    writer.pipes = [Connection(write_fd, readable=False)]
    reader = StepReader(os.dup(writer.fd), Connection(read_fd, writable=False), **writer.setup())
    return writer, reader


def random_step(rng, anonymous: bool) -> StepInputs:
    rows, seats, tokens, positions = [], [], [], []
    for seat in range(int(rng.integers(1, 4))):
        first, n = int(rng.integers(0, 4)), int(rng.integers(1, 4))
        table = [int(p) for p in rng.integers(0, 50, size=first + n + int(rng.integers(0, 2)))]
        rows.append((first, n, bool(rng.integers(0, 2)), table))
        seats.append((seat, int(rng.integers(0, 2))))  # the same owner often: only differences travel
        block = rng.integers(0, 100, size=n * BL)
        block[rng.random(n * BL) < 0.5] = MASK
        tokens.append(block)
        positions.append(np.arange(first * BL, (first + n) * BL))
    flat = np.concatenate(tokens)
    greedy = np.sort(rng.choice(flat.shape[0], size=int(rng.integers(0, flat.shape[0])), replace=False))
    others = rng.integers(0, flat.shape[0], size=int(rng.integers(0, 5)))
    return StepInputs(flat, np.concatenate(positions), rows, np.concatenate([greedy, others]).astype(np.int64),
                      greedy.shape[0], None if anonymous else seats)


def test_a_worker_decodes_exactly_the_step_rank_0_encoded():
    writer, reader = channel_pair()
    rng = np.random.default_rng(0)
    try:
        for step in range(300):
            sent = random_step(rng, anonymous=step % 7 == 0)
            writer.send(sent, extra=[step, 7])
            got, extra = reader.receive()
            assert extra == [step, 7]
            np.testing.assert_array_equal(got.token_ids, sent.token_ids)
            np.testing.assert_array_equal(got.positions, sent.positions)
            np.testing.assert_array_equal(got.logit_index, sent.logit_index)
            assert got.num_greedy == sent.num_greedy
            assert [(f, n, d, list(t)) for f, n, d, t in got.rows] == sent.rows
        writer.send_shutdown()
        assert reader.receive() is None
    finally:
        writer.close()
        reader.close()


def test_an_unchanged_decode_row_sends_no_tokens_and_no_pages():
    writer, reader = channel_pair()
    try:
        block = np.full(BL, MASK)
        step = StepInputs(block, np.arange(BL), [(0, 1, True, [5])], np.arange(BL), BL, [(0, 42)])
        writer.send(step)
        reader.receive()
        first = writer.bytes_sent
        block[1] = 7  # the decoder filled one position
        writer.send(step)
        got, _ = reader.receive()
        assert got.token_ids.tolist() == block.tolist()
        # header 40 + row 12 + one (index, token) pair 8 + a 1-byte bitmask (aligned) + doorbell 12
        assert writer.bytes_sent - first <= 40 + 12 + 8 + 4 + 12
    finally:
        writer.close()
        reader.close()
