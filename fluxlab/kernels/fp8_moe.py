"""Block-scaled FP8 fused MoE (Triton): kernels/fused_moe.py with e4m3 expert weights.

`fp8_fused_moe(x, topk_idx, topk_weight, w_gate_up, s_gate_up, w_down, s_down)` computes what
`fluxlab.engine.layers.fp8.fp8_moe_reference` defines, in six launches with no host sync:

1. the align of kernels/moe_align.py (slots sorted into BLOCK_M-padded runs per expert);
2. `quantize_act` (kernels/fp8_gemm.py): x per token and 128-wide group to e4m3 + scales, once;
3. `_fp8_gate_up_kernel`: each K-step loads the gathered e4m3 x rows [BLOCK_M, 128] and their scales
   and takes e4m3 dots with the gate and the up tiles, each scaled by its block's `weight_scale_inv`;
   act(gate) * up in the fp32 epilogue, rounded to x.dtype, and, since a program's 128 columns are
   one group, quantized there: the intermediate is stored as e4m3 + scales;
4. `_fp8_down_kernel`: the same over the intermediate rows and w_down, times the routing weight,
   stored per token-slot in x.dtype;
5. the combine of kernels/fused_moe.py (slot sum in fp32, then the shared expert and the residual).

Weights: w_gate_up [E, 2I, H] e4m3 with s_gate_up [E, 2*ceil(I/128), ceil(H/128)] (gate blocks, then
up blocks), w_down [E, H, I] e4m3 with s_down [E, ceil(H/128), ceil(I/128)]: the checkpoint's
per-expert `weight_scale_inv` grids stacked.

One tile config per call whatever the token count (`FP8MoEConfig`, BLOCK_K = 128, the quantization
group): a token's output does not depend on the batch, and the config is fixed at capture.
"""
from __future__ import annotations

import dataclasses
import json
import os

import torch

from fluxlab.kernels.fp8_gemm import GROUP, _load_scale, _scale_ptrs, _scaled, _scales_at, quant_tile, quantize_act
from fluxlab.kernels.fused_norm import _tl_dtype
from fluxlab.kernels.fused_moe import ACTIVATIONS, combine_slots
from fluxlab.kernels.moe_align import HAVE_TRITON, _interpret, moe_align, tl, triton
from fluxlab.kernels.pdl import launch as pdl_launch, start as pdl_start
from fluxlab.kernels.tile_order import grouped_tile


@dataclasses.dataclass(frozen=True)
class FP8MoEConfig:
    """One config for every token count: on sm90 a tile of 64+ rows takes wgmma, whose e4m3 products
    sum otherwise than mma.sync's (below 64 rows), so a per-count choice would change a row's bits with
    the batch. 64 rows, 8 warps was the fastest single config on the H200 at LLaDA2.0-mini shapes
    (benchmarks/device/fp8_kernels.py, docs/benchmarks.md "FP8 weights"): faster than the bf16 fused MoE
    at 32, 512 and 2048 tokens, where 16 rows lost to bf16 at 2048."""
    BLOCK_M: int = 64     # gate/up: N = I in tiles of 128 (one quantization group), K = H
    WARPS1: int = 8
    STAGES1: int = 3
    BLOCK_N2: int = 128   # down: N = H, K = I
    WARPS2: int = 8
    STAGES2: int = 3
    GROUP_M: int = 8


def default_config() -> FP8MoEConfig:
    """The shipped config; FLUXLAB_FP8_MOE_CONFIG='{"BLOCK_M":64,...}' overrides fields (benchmarks)."""
    cfg = FP8MoEConfig()
    env = os.environ.get("FLUXLAB_FP8_MOE_CONFIG")
    return dataclasses.replace(cfg, **json.loads(env)) if env else cfg


if HAVE_TRITON:
    @triton.jit
    def _fp8_gate_up_kernel(xq_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, outs_ptr, sorted_ids_ptr, expert_ids_ptr,
                            total_ptr, N, TOPK, H, I, num_pid_m, stride_xm, stride_xsm, stride_we, stride_wn,
                            stride_wse, stride_wsn, stride_om, stride_osm, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
                            ACT: tl.constexpr, ROUND_DT: tl.constexpr, INTERPRET: tl.constexpr,
                            PDL: tl.constexpr = False):
        # BLOCK_N == BLOCK_K: a program's columns are one 128-wide group of the intermediate, which its
        # epilogue quantizes for the down GEMM.
        pdl_start(PDL)
        pid = tl.program_id(0)
        pid_m, pid_n = grouped_tile(pid, num_pid_m, tl.cdiv(I, BLOCK_N), GROUP_M)
        total = tl.load(total_ptr)
        if pid_m * BLOCK_M < total:
            offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            slot = tl.load(sorted_ids_ptr + offs_m)
            valid = slot < N
            tok = (slot // TOPK).to(tl.int64)
            e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = offs_n < I
            offs_k = tl.arange(0, BLOCK_K)
            a_ptrs = xq_ptr + tok[:, None] * stride_xm + offs_k[None, :]
            as_ptrs = xs_ptr + tok * stride_xsm
            bg_ptrs = w_ptr + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
            bu_ptrs = bg_ptrs + I * stride_wn
            # gate rows' scale blocks, then up rows' (ceil(I/128) of each); each K-block's loaded a block ahead
            sg_ptrs = _scale_ptrs(ws_ptr + e * stride_wse, pid_n * BLOCK_N, offs_n, stride_wsn, BLOCK_N, BLOCK_K)
            su_ptrs = sg_ptrs + tl.cdiv(I, BLOCK_K) * stride_wsn
            num_kb = tl.cdiv(H, BLOCK_K)
            a_s_next, s_g_next = _scales_at(as_ptrs, sg_ptrs, 0, valid, n_ok, BLOCK_N, BLOCK_K)
            s_u_next = _load_scale(su_ptrs, 0, n_ok, BLOCK_N, BLOCK_K)
            acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for kb in range(0, num_kb):
                if EVEN_K:
                    a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
                    bg = tl.load(bg_ptrs, mask=n_ok[None, :], other=0.0)
                    bu = tl.load(bu_ptrs, mask=n_ok[None, :], other=0.0)
                else:
                    k_ok = offs_k < H - kb * BLOCK_K
                    a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
                    bg = tl.load(bg_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
                    bu = tl.load(bu_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
                a_s, s_g, s_u = a_s_next, s_g_next, s_u_next
                kb_next = tl.minimum(kb + 1, num_kb - 1)  # the last iteration reloads its own block's (unused)
                a_s_next, s_g_next = _scales_at(as_ptrs, sg_ptrs, kb_next, valid, n_ok, BLOCK_N, BLOCK_K)
                s_u_next = _load_scale(su_ptrs, kb_next, n_ok, BLOCK_N, BLOCK_K)
                acc_g += _scaled(tl.dot(a, bg), a_s, s_g, BLOCK_N, BLOCK_K)
                acc_u += _scaled(tl.dot(a, bu), a_s, s_u, BLOCK_N, BLOCK_K)
                a_ptrs += BLOCK_K
                bg_ptrs += BLOCK_K
                bu_ptrs += BLOCK_K
            if ACT == 1:  # gelu, tanh approximation, as kernels/fused_moe.py
                y = 0.7978845608028654 * (acc_g + 0.044715 * acc_g * acc_g * acc_g)
                h = 0.5 * acc_g * (2.0 - 2.0 / (tl.exp(2.0 * y) + 1.0)) * acc_u
            else:
                h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
            # rounded to the activation dtype first, as the bf16 intermediate of the reference
            h_q, h_s = quant_tile(h.to(ROUND_DT).to(tl.float32), INTERPRET)
            o_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
            tl.store(o_ptrs, h_q, mask=valid[:, None] & n_ok[None, :])
            tl.store(outs_ptr + offs_m.to(tl.int64) * stride_osm + pid_n, h_s, mask=valid)

    @triton.jit
    def _fp8_down_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, topk_weight_ptr, sorted_ids_ptr, expert_ids_ptr, total_ptr,
                         N, H, I, num_pid_m, stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                         EVEN_K: tl.constexpr, PDL: tl.constexpr = False):
        pdl_start(PDL)
        pid = tl.program_id(0)
        pid_m, pid_n = grouped_tile(pid, num_pid_m, tl.cdiv(H, BLOCK_N), GROUP_M)
        total = tl.load(total_ptr)
        if pid_m * BLOCK_M < total:
            offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            slot = tl.load(sorted_ids_ptr + offs_m)
            valid = slot < N
            e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = offs_n < H
            offs_k = tl.arange(0, BLOCK_K)
            a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
            as_ptrs = as_ptr + offs_m.to(tl.int64) * stride_asm
            b_ptrs = w_ptr + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
            s_ptrs = _scale_ptrs(ws_ptr + e * stride_wse, pid_n * BLOCK_N, offs_n, stride_wsn, BLOCK_N, BLOCK_K)
            num_kb = tl.cdiv(I, BLOCK_K)
            a_s_next, s_b_next = _scales_at(as_ptrs, s_ptrs, 0, valid, n_ok, BLOCK_N, BLOCK_K)
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for kb in range(0, num_kb):
                if EVEN_K:
                    a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
                    b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
                else:
                    k_ok = offs_k < I - kb * BLOCK_K
                    a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
                    b = tl.load(b_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
                a_s, s_b = a_s_next, s_b_next
                a_s_next, s_b_next = _scales_at(as_ptrs, s_ptrs, tl.minimum(kb + 1, num_kb - 1), valid, n_ok,
                                                BLOCK_N, BLOCK_K)
                acc += _scaled(tl.dot(a, b), a_s, s_b, BLOCK_N, BLOCK_K)
                a_ptrs += BLOCK_K
                b_ptrs += BLOCK_K
            w = tl.load(topk_weight_ptr + slot, mask=valid, other=0.0).to(tl.float32)
            acc = acc * w[:, None]
            o_ptrs = out_ptr + slot[:, None].to(tl.int64) * stride_om + offs_n[None, :]
            tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


def fp8_fused_moe(x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor,
                  w_gate_up: torch.Tensor, s_gate_up: torch.Tensor, w_down: torch.Tensor, s_down: torch.Tensor,
                  config: FP8MoEConfig | None = None, foreign_slots: bool = False, adds: tuple = (),
                  activation: str = "silu", shared_last: bool = False) -> torch.Tensor:
    """x [T, H], topk_idx [T, K], topk_weight [T, K] fp32, e4m3 weights with block scales (module
    doc) -> [T, H] in x.dtype. CUDA-graph capturable; `adds`, `foreign_slots` and `activation` as in
    `fused_moe`; `shared_last` as in `combine_slots` (a shared expert stacked as the last expert and
    routed as every token's last slot: its GEMMs ride this call's launches)."""
    if not HAVE_TRITON:
        raise RuntimeError("fp8_fused_moe needs triton")
    if not x.is_cuda and not _interpret():
        raise RuntimeError("fp8_fused_moe runs on CUDA (or on CPU under TRITON_INTERPRET=1)")
    if activation not in ACTIVATIONS:
        raise ValueError(f"fp8_fused_moe: activation {activation!r}; one of {sorted(ACTIVATIONS)}")
    num_tokens, hidden = x.shape
    top_k = topk_idx.shape[1]
    num_experts, two_i, _ = w_gate_up.shape
    inter = two_i // 2
    nb = -(-inter // GROUP)
    assert w_gate_up.dtype == w_down.dtype == torch.float8_e4m3fn, (w_gate_up.dtype, w_down.dtype)
    assert w_down.shape == (num_experts, hidden, inter), (w_gate_up.shape, w_down.shape)
    assert s_gate_up.shape == (num_experts, 2 * nb, -(-hidden // GROUP)), s_gate_up.shape
    assert s_down.shape == (num_experts, -(-hidden // GROUP), nb), s_down.shape
    if num_tokens == 0:
        return torch.empty_like(x)
    x = x.contiguous()
    topk_weight = topk_weight.reshape(-1).contiguous()
    cfg = config or default_config()
    bm = cfg.BLOCK_M
    sorted_ids, expert_ids, total = moe_align(topk_idx, num_experts, bm)
    num_pid_m = sorted_ids.numel() // bm
    n_slots = num_tokens * top_k

    xq, xs = quantize_act(x)
    inter_q = torch.empty(sorted_ids.numel(), inter, dtype=torch.float8_e4m3fn, device=x.device)
    inter_s = torch.empty(sorted_ids.numel(), nb, dtype=torch.float32, device=x.device)
    _fp8_gate_up_kernel[(num_pid_m * nb,)](
        xq, xs, w_gate_up, s_gate_up, inter_q, inter_s, sorted_ids, expert_ids, total, n_slots, top_k, hidden, inter,
        num_pid_m, xq.stride(0), xs.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), s_gate_up.stride(0),
        s_gate_up.stride(1), inter_q.stride(0), inter_s.stride(0), BLOCK_M=bm, BLOCK_N=GROUP, BLOCK_K=GROUP,
        GROUP_M=cfg.GROUP_M, EVEN_K=hidden % GROUP == 0, ACT=ACTIVATIONS[activation], ROUND_DT=_tl_dtype(x.dtype),
        INTERPRET=_interpret(), num_warps=cfg.WARPS1, num_stages=cfg.STAGES1, **pdl_launch())

    slot_out = (torch.zeros if foreign_slots else torch.empty)(n_slots, hidden, dtype=x.dtype, device=x.device)
    _fp8_down_kernel[(num_pid_m * triton.cdiv(hidden, cfg.BLOCK_N2),)](
        inter_q, inter_s, w_down, s_down, slot_out, topk_weight, sorted_ids, expert_ids, total, n_slots, hidden, inter,
        num_pid_m, inter_q.stride(0), inter_s.stride(0), w_down.stride(0), w_down.stride(1), s_down.stride(0),
        s_down.stride(1), slot_out.stride(0), BLOCK_M=bm, BLOCK_N=cfg.BLOCK_N2, BLOCK_K=GROUP, GROUP_M=cfg.GROUP_M,
        EVEN_K=inter % GROUP == 0, num_warps=cfg.WARPS2, num_stages=cfg.STAGES2, **pdl_launch())
    return combine_slots(slot_out, top_k, adds, x.dtype, shared_last)
