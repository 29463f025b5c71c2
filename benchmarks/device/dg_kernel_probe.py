"""Diffusion-Gemma's batch-16 step kernel by kernel against its floors (one GPU), as CUDA-graph replays.

    python3 benchmarks/device/dg_kernel_probe.py attention [OUT.json]   canvas attention tile configs, b1 / b16
    python3 benchmarks/device/dg_kernel_probe.py moe [OUT.json]         fused MoE stages vs torch._grouped_mm
    python3 benchmarks/device/dg_kernel_probe.py moe_sweep              per-stage MoE tiles at one canvas (bits checked)
    python3 benchmarks/device/dg_kernel_probe.py stats                  the sampler's statistics, 1024 positions
    python3 benchmarks/device/dg_kernel_probe.py once KERNEL BATCH      one warm call of a kernel (for ncu -k)

26B-A4B shapes, random bf16 values. `attention` times the canvas attention kernel alone (sliding: 8 KV heads of 256;
full: 2 of 512; 16 query heads; a canvas of 256 over `PREFIX` cached keys), every config of CANDIDATES checked for
bits against the first (the shipped one) and each reported with its TFLOP/s. `moe` times the gate/up and down stages of
the fused MoE (layers.canvas_moe_config) and the same products as torch._grouped_mm over rows sorted by expert (the
gather left out), with whether grouped_mm gives a canvas inside 4096 tokens the bits of that canvas alone.
`once attention_sliding|attention_full|moe|stats 16` runs three warm calls for `ncu --launch-skip 2 --launch-count 1`.
"""
from __future__ import annotations

import json
import sys

import torch

import fluxlab.kernels.canvas_attention as ca
# this directory (the script's sys.path[0])
from diffusion_gemma_moe_tiles import E, H, I, TOP_K, case as moe_case, expert_weights
from fluxlab.bench.moe_tune import graph_ms as replay_ms

L, WINDOW, HEADS, PREFIX = 256, 1024, 16, 512
LAYERS = {"sliding": (8, 256, True), "full": (2, 512, False)}
# The table's key block first (the bits every other candidate must keep); the last ones change the key block, so
# their bits differ (`same` False): they could only replace the table's tile and the tall one together. For sm90 the
# 32-key tiles of head dim 256 compile without spills, the 64-key ones spill 16-144 bytes a thread; at 512 the 16-key
# tile spills 128, the table's 208 (benchmarks/device/canvas_attention_sm90.py, triton 3.9, 2026-12-07).
CANDIDATES = {256: [(64, 64, 8, 2), (128, 64, 8, 2), (64, 64, 4, 2), (128, 64, 8, 1), (64, 64, 8, 3), (128, 64, 16, 1),
                    (128, 64, 16, 2), (64, 64, 16, 2), (64, 32, 8, 2), (128, 32, 8, 2), (128, 32, 8, 3)],
              512: [(64, 32, 8, 2), (64, 32, 8, 1), (128, 32, 8, 1), (64, 32, 8, 3), (64, 32, 16, 2), (64, 32, 16, 1),
                    (128, 32, 16, 1), (64, 16, 8, 2)]}


def graph_ms(fn, inner: int = 10) -> float:
    """ms a call: `inner` calls in one CUDA graph (a replay's launch spread over them)."""
    return replay_ms(lambda: [fn() for _ in range(inner)]) / inner


def attention_case(batch: int, kind: str):
    from fluxlab.models.diffusion_gemma.paged_attention import build_canvas_metadata
    from diffusion_gemma_attention_tiles import setup

    kv_heads, head_dim, sliding = LAYERS[kind]
    cache, rows, q, k, v = setup(batch, PREFIX, kv_heads, head_dim, sliding)
    meta = build_canvas_metadata(rows, L, WINDOW, torch.device("cuda"), masks=False)
    args = (q, k, v, cache.k[0], cache.v[0], meta.query_gather, meta.canvas_gather, meta.key_slots[sliding],
            meta.geometry[sliding], meta.window if sliding else 0)
    fresh = meta.fresh_keys if sliding and meta.has_fresh else None  # the engine's rule: None in a denoise step
    flops = 4.0 * batch * L * (L + PREFIX) * head_dim * HEADS
    return (lambda: ca.canvas_attention(*args, fresh=fresh)), flops, head_dim


def attention(out: str | None) -> None:
    """Each candidate config at every grid size (TALL_TILES off), then the shipped rule ("shipped": the table's tile
    or TALL_TILES by grid size), every output against the first candidate's (the table's)."""
    results = []
    print(f"{'batch':>5} {'layer':>8} {'config':>16} {'ms':>8} {'TFLOP/s':>8} same")
    tall_from = ca.TALL_FROM_PROGRAMS
    for batch in (1, 16):
        for kind in LAYERS:
            call, flops, head_dim = attention_case(batch, kind)
            shipped = ca.CONFIGS[head_dim]
            reference = None
            for config in [*CANDIDATES[head_dim], "shipped"]:
                ca.TALL_FROM_PROGRAMS = tall_from if config == "shipped" else 1 << 62
                ca.CONFIGS[head_dim] = shipped if config == "shipped" else config
                ca._FITTED.clear()
                ca._NO_TALL.clear()
                try:
                    got = call().clone()
                    reference = got if reference is None else reference  # the table's tile
                    ms = graph_ms(call)
                    same = torch.equal(got, reference)
                except Exception as e:  # noqa: BLE001 - a config out of registers / shared memory
                    print(f"  {config}: {type(e).__name__}: {str(e)[:100]}")
                    ms, same = float("nan"), None
                ran = next(iter(ca._FITTED.values()), config)  # a config the device refused steps down
                if ca._NO_TALL:
                    ran = "table (tall refused)"
                results.append(dict(batch=batch, layer=kind, config=config, ran=ran, ms=ms, tflops=flops / ms / 1e9,
                                    same=same))
                print(f"{batch:>5} {kind:>8} {str(config):>16} {ms:8.4f} {flops / ms / 1e9:8.1f} {same}"
                      + ("" if ran == config else f" (ran {ran})"))
            ca.CONFIGS[head_dim] = shipped
            ca._FITTED.clear()
    ca.TALL_FROM_PROGRAMS = tall_from
    if out:
        with open(out, "w") as f:
            json.dump(dict(prefix=PREFIX, results=results), f, indent=1)


def moe(out: str | None) -> None:
    from fluxlab.kernels.fused_moe import down_stage, gate_up_stage
    from fluxlab.kernels.moe_align import moe_align
    from fluxlab.models.diffusion_gemma.layers import canvas_moe_config

    gen = torch.Generator(device="cuda").manual_seed(0)
    w_gate_up, w_down = expert_weights(gen)
    w_gate_up_t, w_down_t = w_gate_up.transpose(1, 2), w_down.transpose(1, 2)
    results, alone = [], None
    for tokens in (256, 4096):
        x, index, weights = moe_case(tokens, gen)
        if alone is not None:  # the first canvas of the batch is the canvas timed alone
            x[:256], index[:256], weights[:256] = alone
        cfg = canvas_moe_config(tokens)
        sorted_ids, expert_ids, total = moe_align(index, E, cfg.BLOCK_M)
        inter = gate_up_stage(x, w_gate_up, sorted_ids, expert_ids, total, TOP_K, cfg, "gelu_tanh")
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=E)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        sorted_x = x.index_select(0, order // TOP_K)
        gu = torch._grouped_mm(sorted_x, w_gate_up_t, offs=offs)
        h = (torch.nn.functional.gelu(gu[:, :I], approximate="tanh") * gu[:, I:]).contiguous()
        slots = tokens * TOP_K
        row = {"tokens": tokens,
               "fused gate/up": graph_ms(lambda: gate_up_stage(x, w_gate_up, sorted_ids, expert_ids, total, TOP_K, cfg,
                                                               "gelu_tanh")),
               "fused down": graph_ms(lambda: down_stage(inter, w_down, weights.reshape(-1), sorted_ids, expert_ids,
                                                         total, cfg)),
               "grouped_mm gate/up": graph_ms(lambda: torch._grouped_mm(sorted_x, w_gate_up_t, offs=offs)),
               "grouped_mm down": graph_ms(lambda: torch._grouped_mm(h, w_down_t, offs=offs)),
               "gather x": graph_ms(lambda: x.index_select(0, order // TOP_K))}
        gflop = 2.0 * slots * H * I
        row.update({"gate/up floor ms": 2 * gflop / 989e9 * 1e3, "down floor ms": gflop / 989e9 * 1e3})
        if alone is None:
            alone = (x.clone(), index.clone(), weights.clone())
            first_gu = gu.clone()
            first_order = order.clone()
        else:  # rows of the first canvas's slots, in grouped_mm's order, against the canvas alone
            inverse = torch.empty_like(order)
            inverse[order] = torch.arange(order.numel(), device="cuda")
            first_inverse = torch.empty_like(first_order)
            first_inverse[first_order] = torch.arange(first_order.numel(), device="cuda")
            row["grouped_mm canvas bits = alone"] = torch.equal(gu[inverse[:256 * TOP_K]], first_gu[first_inverse])
        results.append(row)
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()})
    if out:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)


GATE_UP_TILES = [(64, 128, 4, 4), (32, 128, 4, 4), (64, 64, 4, 6), (64, 256, 4, 2), (128, 64, 8, 4), (64, 128, 4, 5),
                 (64, 128, 8, 4), (64, 128, 4, 3)]  # (BLOCK_N1, BLOCK_K1, WARPS1, STAGES1), the shipped first
DOWN_TILES = [(128, 64, 4, 4), (64, 64, 4, 4), (64, 128, 4, 3), (128, 128, 4, 3), (256, 64, 8, 3), (128, 64, 8, 4),
              (128, 64, 4, 5), (256, 64, 4, 3), (64, 64, 4, 6)]  # (BLOCK_N2, BLOCK_K2, WARPS2, STAGES2)


def moe_sweep() -> None:
    """Each stage of the canvas MoE alone at 256 tokens (one canvas), per tile, graph replays, with and without TMA
    weight tiles; 'same' = the shipped config's bits."""
    import dataclasses

    from fluxlab.kernels.fused_moe import down_stage, gate_up_stage
    from fluxlab.kernels.moe_align import moe_align
    from fluxlab.models.diffusion_gemma.layers import canvas_moe_config

    gen = torch.Generator(device="cuda").manual_seed(0)
    w_gate_up, w_down = expert_weights(gen)
    x, index, weights = moe_case(L, gen)
    shipped = canvas_moe_config(L)
    sorted_ids, expert_ids, total = moe_align(index, E, shipped.BLOCK_M)
    inter = gate_up_stage(x, w_gate_up, sorted_ids, expert_ids, total, TOP_K, shipped, "gelu_tanh")
    used = sorted_ids < L * TOP_K  # padding rows of `inter` are never written: compare the rows of slots
    want_down = down_stage(inter, w_down, weights.reshape(-1), sorted_ids, expert_ids, total, shipped)
    # (name, tiles, the config fields a tile sets, weight, the stage, its shipped output, the rows compared)
    stages = [("gate/up", GATE_UP_TILES, ("BLOCK_N1", "BLOCK_K1", "WARPS1", "STAGES1", "TMA1"), w_gate_up,
               lambda cfg: gate_up_stage(x, w_gate_up, sorted_ids, expert_ids, total, TOP_K, cfg, "gelu_tanh"),
               inter, used),
              ("down", DOWN_TILES, ("BLOCK_N2", "BLOCK_K2", "WARPS2", "STAGES2", "TMA2"), w_down,
               lambda cfg: down_stage(inter, w_down, weights.reshape(-1), sorted_ids, expert_ids, total, cfg),
               want_down, slice(None))]
    for tma in (0, 1):
        for name, tiles, fields, weight, stage, want, rows in stages:
            for tile in tiles:
                cfg = dataclasses.replace(shipped, **dict(zip(fields, (*tile, tma))))
                try:
                    same = torch.equal(stage(cfg)[rows], want[rows])
                    ms = graph_ms(lambda cfg=cfg: stage(cfg))
                except Exception as e:  # noqa: BLE001 - out of shared memory
                    print(f"{name} {tile} tma={tma}: {type(e).__name__}")
                    continue
                print(f"{name:7} {str(tile):>18} tma={tma} {ms:.4f} ms {weight.numel() * 2 / ms / 1e6:6.0f} GB/s "
                      f"same={same}")


def stats_case(rows: int):
    from fluxlab.kernels.canvas_stats import canvas_stats

    gen = torch.Generator(device="cuda").manual_seed(0)
    raw = (torch.randn(rows, 262144, generator=gen, device="cuda") * 8).to(torch.bfloat16)
    noise = torch.empty(rows, 262144, device="cuda").exponential_(generator=gen)
    temperature = torch.rand(rows, generator=gen, device="cuda") * 0.4 + 0.6
    return lambda: canvas_stats(raw, temperature, 30.0, noise, torch.bfloat16)


def stats() -> None:
    """ms of canvas_stats at the runner's chunk of 16 canvases (1024 positions), and a digest of its outputs to
    compare trees (the same digest = the same bits)."""
    call = stats_case(1024)
    argmax, entropy, probs, sample = call()
    digest = (int(argmax.sum()), float(entropy.double().sum()), float(probs.double().sum()), int(sample.sum()))
    print(f"stats 1024 x 262144: {graph_ms(call, inner=4):.4f} ms a call; digest {digest}")


def once(kernel: str, batch: int) -> None:
    if kernel.startswith("attention_"):
        call, _, _ = attention_case(batch, kernel.removeprefix("attention_"))
    elif kernel == "moe":
        from fluxlab.kernels.fused_moe import fused_moe
        from fluxlab.models.diffusion_gemma.layers import canvas_moe_config
        gen = torch.Generator(device="cuda").manual_seed(0)
        w_gate_up, w_down = expert_weights(gen)
        x, index, weights = moe_case(batch * L, gen)
        cfg = canvas_moe_config(batch * L)
        call = lambda: fused_moe(x, index, weights, w_gate_up, w_down, config=cfg, activation="gelu_tanh")  # noqa: E731
    elif kernel == "stats":
        call = stats_case(batch * L // 4)  # the runner's chunk of rows (a quarter of 16 canvases)
    else:
        raise SystemExit(f"once: no kernel {kernel!r}")
    for _ in range(3):
        call()
    torch.cuda.synchronize()


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "attention":
        attention(sys.argv[2] if len(sys.argv) > 2 else None)
    elif mode == "moe":
        moe(sys.argv[2] if len(sys.argv) > 2 else None)
    elif mode == "stats":
        stats()
    elif mode == "moe_sweep":
        moe_sweep()
    elif mode == "once":
        once(sys.argv[2], int(sys.argv[3]))
    else:
        raise SystemExit(__doc__)
