"""Device time of one decode step (logits of the active blocks -> new blocks), per decoder (GPU).

    python -m fluxlab.bench.decoder_step [--rows 1,16,64] [--block 32] [--vocab 157184]

The forward is the same whatever the decoder; what differs is the step after it. joint_threshold
takes argmax + probability from the one-pass kernel over bf16 logits, then its accept/final rule;
levenshtein_joint (LLaDA2.2) needs the full fp32 logits of its rows (argmax without the mask id,
next-best tokens, the edit scan). Random bf16 logits, CUDA events, median of 20 steps.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch


def _time(fn, before=None, iters: int = 20) -> float:
    times = []
    for i in range(iters + 3):
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    from fluxlab.engine.decoding.base import DecodeBatch
    from fluxlab.engine.decoding.joint_threshold import JointThreshold
    from fluxlab.engine.decoding.levenshtein_joint import LevenshteinKnobs, LevenshteinState, levenshtein_step
    from fluxlab.kernels.vocab_stats import greedy_stats

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=157184)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "decoder_step.json"))
    args = ap.parse_args()
    device, bl, vocab = torch.device("cuda"), args.block, args.vocab
    mask_id, delete_id, split_id = vocab - 289, vocab - 254, vocab - 253
    results = []
    for rows in [int(r) for r in args.rows.split(",")]:
        gen = torch.Generator(device=device).manual_seed(rows)
        logits = (torch.randn(rows, bl, vocab, generator=gen, device=device) * 3).to(torch.bfloat16)
        block = torch.full((rows, bl), mask_id, device=device)
        block[:, : bl // 2] = torch.randint(0, 1000, (rows, bl // 2), generator=gen, device=device)
        prompt = torch.zeros(rows, dtype=torch.long, device=device)
        editable = torch.ones(rows, bl, dtype=torch.bool, device=device)
        knobs = {"threshold": torch.full((rows,), 0.5, device=device),
                 "editing_threshold": torch.zeros(rows, device=device),
                 "max_post_steps": torch.full((rows,), 16, device=device, dtype=torch.long)}

        def joint():
            tokens, conf = greedy_stats(logits.view(-1, vocab))
            batch = DecodeBatch(tokens.view(rows, bl), conf.view(rows, bl), block, block == mask_id, editable, knobs,
                                {"post_steps": torch.zeros(rows, dtype=torch.long, device=device)}, mask_id)
            JointThreshold().step(batch)

        state = LevenshteinState.empty(rows, bl, 1000, device)
        lev_knobs = LevenshteinKnobs(knobs["threshold"], knobs["editing_threshold"],
                                     torch.full((rows,), 32, device=device, dtype=torch.long), knobs["max_post_steps"],
                                     torch.full((rows,), 1000, device=device, dtype=torch.long))
        all_rows = torch.arange(rows, device=device)

        def enter():
            state.enter_block(all_rows, block, prompt, mask_id)

        def levenshtein():
            levenshtein_step(logits, block, prompt, state, lev_knobs, mask_id=mask_id, delete_id=delete_id,
                             split_id=split_id)

        row = {"rows": rows, "block": bl, "vocab": vocab, "joint_threshold_ms": _time(joint),
               "levenshtein_joint_ms": _time(levenshtein, before=enter)}
        results.append(row)
        print(f"decoder_step rows={rows:>3}: joint_threshold {row['joint_threshold_ms']:.3f} ms, "
              f"levenshtein_joint {row['levenshtein_joint_ms']:.3f} ms", flush=True)
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
