"""Fused MoE for the LLaDA2 decode step (Triton), plus a sync-free `torch._grouped_mm` path.

`fused_moe(x, topk_idx, topk_weight, w_gate_up, w_down)` computes the same thing as
`fluxlab.engine.layers.moe.moe_reference`:

    out[t] = sum_k w[t, k] * down_e( silu(gate_e(x[t])) * up_e(x[t]) ),  e = topk_idx[t, k]

with w_gate_up [E, 2I, H] (rows: gate then up) and w_down [E, H, I], in a few launches and with no
host synchronisation, so it can be captured in a CUDA graph:

1. the align (kernels/moe_align.py: a counting sort in O(slots), one to three launches): each
   expert gets a BLOCK_M-padded run of rows in a buffer sized for the worst case
   (T*K + min(E, T*K)*(BLOCK_M-1) rows): sorted_ids (the flat token-slot index t*K+k, or the
   sentinel T*K in padding rows), expert_ids (the expert of every BLOCK_M row block) and the number
   of used rows (`total`, on device). Slots keep their original order inside an expert.
2. `_gate_up_kernel`: grouped GEMM x[tok] @ w_gate_up[e]^T, gate and up tiles for the same
   N-columns in two accumulators, act(gate)*up in the epilogue -> inter [rows, I] (x.dtype); act is
   SiLU (LLaDA2) or gelu-tanh (Diffusion-Gemma, `activation="gelu_tanh"`).
3. `_down_kernel`: grouped GEMM inter @ w_down[e]^T, times the routing weight (fp32) in the
   epilogue, stored per token-slot -> [T*K, H] (x.dtype).
4. `_combine_kernel`: the K slots of each token summed in fp32 (k = 0, 1, ... in order) and rounded
   to x.dtype, then each tensor of `adds` (the shared expert's output, the residual) added with
   torch's rounding (fp32 sum rounded once per add): the layer's tail in one pass over the slots
   instead of a reduce, a cast and an add per tensor.

Row blocks past `total` (and programs whose block is past it) exit at once: the grid is sized by
the worst case and the work by the device-side count. With SHRINK1/SHRINK2 > 0 a row block whose
rows fit in half (a quarter) of BLOCK_M runs a GEMM of that height. A row's value should not
change (each row of a tl.dot is its own dot product, accumulated over K in the same order), but
the smaller tile may get another MMA instruction (mma.sync below 64 rows on sm90, wgmma above),
so tests/test_fused_moe.py and `python -m fluxlab.bench.moe_layer --old-vs-new` check the bits on the GPU, and a table
ships only shrinks that kept them.
With TMA1/TMA2 (sm90+) the weight tiles are loaded through a TMA tensor descriptor instead of
pointer loads; the activations stay gathered pointer loads.

Tile configs: kernels/moe_config.py (a measured table per GPU, else a heuristic); `config=` overrides.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fluxlab.kernels.moe_align import (HAVE_TRITON, _interpret, _patch_interpreter_for_numpy2,  # noqa: F401
                                       max_padded_rows, moe_align, tl, triton)
from fluxlab.kernels.moe_config import MoEConfig, default_config
from fluxlab.kernels.pdl import launch as pdl_launch, start as pdl_start
from fluxlab.kernels.tile_order import grouped_tile

if HAVE_TRITON:
    from fluxlab.kernels.fused_norm import _rnd, _tl_dtype

    @triton.jit
    def _gate_up_rows(x_ptr, w_ptr, w_desc, out_ptr, sorted_ids_ptr, row0, e_ptr, pid_n, N, TOPK, H, I,
                      stride_xm, stride_we, stride_wn, stride_wk, stride_om,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      EVEN_K: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr, ACT: tl.constexpr):
        # rows row0 .. row0+BLOCK_M-1 (expert *e_ptr), columns pid_n*BLOCK_N.. of gate and of up.
        # TMA: the weight tiles come through w_desc (w as [E*2I, H]); columns past I read the next
        # rows (or zeros past the end), only ever into output columns the store masks.
        offs_m = row0 + tl.arange(0, BLOCK_M)
        slot = tl.load(sorted_ids_ptr + offs_m)
        valid = slot < N
        tok = (slot // TOPK).to(tl.int64)
        e = tl.load(e_ptr).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = x_ptr + tok[:, None] * stride_xm + offs_k[None, :]
        if TMA:
            w_row = (e * 2 * I + pid_n * BLOCK_N).to(tl.int32)
        else:
            offs_bn = (offs_n % I).to(tl.int64)   # wrap instead of masking the weight loads
            bg_ptrs = w_ptr + e * stride_we + offs_bn[None, :] * stride_wn + offs_k[:, None] * stride_wk
            bu_ptrs = bg_ptrs + I * stride_wn
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(0, tl.cdiv(H, BLOCK_K)):
            if TMA:
                if EVEN_K:
                    a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
                else:
                    a = tl.load(a_ptrs, mask=valid[:, None] & (offs_k[None, :] < H - k * BLOCK_K), other=0.0)
                bg = w_desc.load([w_row, k * BLOCK_K]).T
                bu = w_desc.load([w_row + I, k * BLOCK_K]).T
            elif EVEN_K:
                a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
                bg = tl.load(bg_ptrs)
                bu = tl.load(bu_ptrs)
            else:
                k_ok = offs_k < H - k * BLOCK_K
                a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
                bg = tl.load(bg_ptrs, mask=k_ok[:, None], other=0.0)
                bu = tl.load(bu_ptrs, mask=k_ok[:, None], other=0.0)
            if IEEE:
                acc_g = tl.dot(a, bg, acc_g, input_precision="ieee")
                acc_u = tl.dot(a, bu, acc_u, input_precision="ieee")
            else:
                acc_g = tl.dot(a, bg, acc_g)
                acc_u = tl.dot(a, bu, acc_u)
            a_ptrs += BLOCK_K
            if not TMA:
                bg_ptrs += BLOCK_K * stride_wk
                bu_ptrs += BLOCK_K * stride_wk
        if ACT == 1:  # gelu, tanh approximation (Gemma's gelu_pytorch_tanh), tanh(y) = 1 - 2 / (exp(2y) + 1)
            y = 0.7978845608028654 * (acc_g + 0.044715 * acc_g * acc_g * acc_g)
            h = 0.5 * acc_g * (2.0 - 2.0 / (tl.exp(2.0 * y) + 1.0)) * acc_u
        else:  # SiLU (LLaDA2)
            h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        o_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(o_ptrs, h.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < I))

    @triton.jit
    def _gate_up_kernel(x_ptr, w_ptr, w_desc, out_ptr, sorted_ids_ptr, expert_ids_ptr, total_ptr,
                        N, TOPK, H, I, num_pid_m,
                        stride_xm, stride_we, stride_wn, stride_wk, stride_om,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr, SHRINK_M: tl.constexpr, EVEN_K: tl.constexpr,
                        IEEE: tl.constexpr, TMA: tl.constexpr, ACT: tl.constexpr, PDL: tl.constexpr = False):
        pdl_start(PDL)
        pid = tl.program_id(0)
        num_pid_n = tl.cdiv(I, BLOCK_N)
        pid_m, pid_n = grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M)
        total = tl.load(total_ptr)
        if pid_m * BLOCK_M < total:
            row0 = pid_m * BLOCK_M
            e_ptr = expert_ids_ptr + pid_m
            # An expert's last tile holds its leftover rows first: where they fit in the first half
            # (quarter), run a half- (quarter-) height GEMM instead of multiplying padding.
            if SHRINK_M == 0:
                _gate_up_rows(x_ptr, w_ptr, w_desc, out_ptr, sorted_ids_ptr, row0, e_ptr, pid_n, N, TOPK, H, I,
                              stride_xm, stride_we, stride_wn, stride_wk, stride_om,
                              BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, IEEE, TMA, ACT)
            elif tl.load(sorted_ids_ptr + row0 + BLOCK_M // 2) < N:
                _gate_up_rows(x_ptr, w_ptr, w_desc, out_ptr, sorted_ids_ptr, row0, e_ptr, pid_n, N, TOPK, H, I,
                              stride_xm, stride_we, stride_wn, stride_wk, stride_om,
                              BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, IEEE, TMA, ACT)
            elif SHRINK_M == 1:
                _gate_up_rows(x_ptr, w_ptr, w_desc, out_ptr, sorted_ids_ptr, row0, e_ptr, pid_n, N, TOPK, H, I,
                              stride_xm, stride_we, stride_wn, stride_wk, stride_om,
                              BLOCK_M // 2, BLOCK_N, BLOCK_K, EVEN_K, IEEE, TMA, ACT)
            elif tl.load(sorted_ids_ptr + row0 + BLOCK_M // 4) < N:
                _gate_up_rows(x_ptr, w_ptr, w_desc, out_ptr, sorted_ids_ptr, row0, e_ptr, pid_n, N, TOPK, H, I,
                              stride_xm, stride_we, stride_wn, stride_wk, stride_om,
                              BLOCK_M // 2, BLOCK_N, BLOCK_K, EVEN_K, IEEE, TMA, ACT)
            else:
                _gate_up_rows(x_ptr, w_ptr, w_desc, out_ptr, sorted_ids_ptr, row0, e_ptr, pid_n, N, TOPK, H, I,
                              stride_xm, stride_we, stride_wn, stride_wk, stride_om,
                              BLOCK_M // 4, BLOCK_N, BLOCK_K, EVEN_K, IEEE, TMA, ACT)

    @triton.jit
    def _down_rows(a_ptr, w_ptr, w_desc, out_ptr, topk_weight_ptr, sorted_ids_ptr, row0, e_ptr, pid_n, N, H, I,
                   stride_am, stride_we, stride_wn, stride_wk, stride_om,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   EVEN_K: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr):
        offs_m = row0 + tl.arange(0, BLOCK_M)
        slot = tl.load(sorted_ids_ptr + offs_m)
        valid = slot < N
        e = tl.load(e_ptr).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
        if TMA:   # w as [E*H, I], as in _gate_up_rows
            w_row = (e * H + pid_n * BLOCK_N).to(tl.int32)
        else:
            offs_bn = (offs_n % H).to(tl.int64)
            b_ptrs = w_ptr + e * stride_we + offs_bn[None, :] * stride_wn + offs_k[:, None] * stride_wk
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(0, tl.cdiv(I, BLOCK_K)):
            if TMA:
                if EVEN_K:
                    a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
                else:
                    a = tl.load(a_ptrs, mask=valid[:, None] & (offs_k[None, :] < I - k * BLOCK_K), other=0.0)
                b = w_desc.load([w_row, k * BLOCK_K]).T
            elif EVEN_K:
                a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
                b = tl.load(b_ptrs)
            else:
                k_ok = offs_k < I - k * BLOCK_K
                a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
            a_ptrs += BLOCK_K
            if not TMA:
                b_ptrs += BLOCK_K * stride_wk
        w = tl.load(topk_weight_ptr + slot, mask=valid, other=0.0).to(tl.float32)
        acc = acc * w[:, None]
        o_ptrs = out_ptr + slot[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < H))

    @triton.jit
    def _down_kernel(a_ptr, w_ptr, w_desc, out_ptr, topk_weight_ptr, sorted_ids_ptr, expert_ids_ptr, total_ptr,
                     N, H, I, num_pid_m,
                     stride_am, stride_we, stride_wn, stride_wk, stride_om,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, SHRINK_M: tl.constexpr, EVEN_K: tl.constexpr,
                     IEEE: tl.constexpr, TMA: tl.constexpr, PDL: tl.constexpr = False):
        pdl_start(PDL)
        pid = tl.program_id(0)
        num_pid_n = tl.cdiv(H, BLOCK_N)
        pid_m, pid_n = grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M)
        total = tl.load(total_ptr)
        if pid_m * BLOCK_M < total:
            row0 = pid_m * BLOCK_M
            e_ptr = expert_ids_ptr + pid_m
            if SHRINK_M == 0:  # as in _gate_up_kernel
                _down_rows(a_ptr, w_ptr, w_desc, out_ptr, topk_weight_ptr, sorted_ids_ptr, row0, e_ptr, pid_n, N, H, I,
                           stride_am, stride_we, stride_wn, stride_wk, stride_om,
                           BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, IEEE, TMA)
            elif tl.load(sorted_ids_ptr + row0 + BLOCK_M // 2) < N:
                _down_rows(a_ptr, w_ptr, w_desc, out_ptr, topk_weight_ptr, sorted_ids_ptr, row0, e_ptr, pid_n, N, H, I,
                           stride_am, stride_we, stride_wn, stride_wk, stride_om,
                           BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, IEEE, TMA)
            elif SHRINK_M == 1:
                _down_rows(a_ptr, w_ptr, w_desc, out_ptr, topk_weight_ptr, sorted_ids_ptr, row0, e_ptr, pid_n, N, H, I,
                           stride_am, stride_we, stride_wn, stride_wk, stride_om,
                           BLOCK_M // 2, BLOCK_N, BLOCK_K, EVEN_K, IEEE, TMA)
            elif tl.load(sorted_ids_ptr + row0 + BLOCK_M // 4) < N:
                _down_rows(a_ptr, w_ptr, w_desc, out_ptr, topk_weight_ptr, sorted_ids_ptr, row0, e_ptr, pid_n, N, H, I,
                           stride_am, stride_we, stride_wn, stride_wk, stride_om,
                           BLOCK_M // 2, BLOCK_N, BLOCK_K, EVEN_K, IEEE, TMA)
            else:
                _down_rows(a_ptr, w_ptr, w_desc, out_ptr, topk_weight_ptr, sorted_ids_ptr, row0, e_ptr, pid_n, N, H, I,
                           stride_am, stride_we, stride_wn, stride_wk, stride_om,
                           BLOCK_M // 4, BLOCK_N, BLOCK_K, EVEN_K, IEEE, TMA)


    @triton.jit
    def _combine_kernel(slot_ptr, add1_ptr, add2_ptr, out_ptr, H, TOPK: tl.constexpr, NUM_ADDS: tl.constexpr,
                        SHARED: tl.constexpr, BLOCK: tl.constexpr, DT: tl.constexpr, PDL: tl.constexpr = False):
        pdl_start(PDL)
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < H
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for k in tl.static_range(TOPK - SHARED):
            acc += tl.load(slot_ptr + (t * TOPK + k) * H + cols, mask=inside, other=0.0).to(tl.float32)
        y = _rnd(acc, DT)
        if SHARED:  # the last slot is a shared expert's output: added as the first of `adds` would be
            y = _rnd(y + tl.load(slot_ptr + (t * TOPK + TOPK - 1) * H + cols, mask=inside, other=0.0).to(tl.float32),
                     DT)
        if NUM_ADDS >= 1:
            y = _rnd(y + tl.load(add1_ptr + t * H + cols, mask=inside, other=0.0).to(tl.float32), DT)
        if NUM_ADDS >= 2:
            y = _rnd(y + tl.load(add2_ptr + t * H + cols, mask=inside, other=0.0).to(tl.float32), DT)
        tl.store(out_ptr + t * H + cols, y.to(out_ptr.dtype.element_ty), mask=inside)


# ----------------------------------------------------------------------------------------------
# Host wrappers (no host sync: every size below is a function of shapes only)
# ----------------------------------------------------------------------------------------------

def fused_moe(x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor,
              w_gate_up: torch.Tensor, w_down: torch.Tensor, config: MoEConfig | None = None,
              foreign_slots: bool = False, align=None, adds: tuple = (), activation: str = "silu") -> torch.Tensor:
    """x [T, H], topk_idx [T, K] int, topk_weight [T, K] fp32, w_gate_up [E, 2I, H], w_down [E, H, I]
    -> [T, H] in x.dtype. CUDA-graph capturable (no host sync, shapes only from input shapes).

    adds: up to two [T, H] tensors of x.dtype added to the result in order, each rounded as torch's
    add (`((moe + adds[0]) + adds[1])`), in the combine's pass.

    activation: the gate's nonlinearity, "silu" (LLaDA2's SwiGLU) or "gelu_tanh" (Diffusion-Gemma's
    GeGLU, torch's gelu(approximate="tanh")), applied to the fp32 accumulator in the epilogue.

    foreign_slots: some ids are E (expert parallel: routed to another rank). The align step never
    places them, so no GEMM work is spent on them, and they add zero to the combine.
    align: the align step (default `moe_align`; `moe_align_scan` to compare)."""
    if not HAVE_TRITON:
        raise RuntimeError("fused_moe needs triton")
    if not x.is_cuda and not _interpret():
        raise RuntimeError("fused_moe runs on CUDA (or on CPU under TRITON_INTERPRET=1)")
    num_tokens, hidden = x.shape
    top_k = topk_idx.shape[1]
    num_experts, two_i, hidden_w = w_gate_up.shape
    inter = two_i // 2
    assert hidden_w == hidden and w_down.shape == (num_experts, hidden, inter), (x.shape, w_gate_up.shape, w_down.shape)
    out_dtype = x.dtype
    if num_tokens == 0:
        return torch.empty_like(x)
    x = x.contiguous()
    w_gate_up = w_gate_up if w_gate_up.stride(-1) == 1 else w_gate_up.contiguous()
    w_down = w_down if w_down.stride(-1) == 1 else w_down.contiguous()
    if x.dtype != w_gate_up.dtype:
        x = x.to(w_gate_up.dtype)
    topk_weight = topk_weight.reshape(-1).contiguous()
    cfg = config or default_config(num_tokens, top_k, num_experts, hidden, inter, x.dtype, x.device)
    align = align or moe_align
    sorted_ids, expert_ids, total = align(topk_idx, num_experts, cfg.BLOCK_M)
    inter_buf = gate_up_stage(x, w_gate_up, sorted_ids, expert_ids, total, top_k, cfg, activation)
    slot_out = down_stage(inter_buf, w_down, topk_weight, sorted_ids, expert_ids, total, cfg, foreign_slots)
    return combine_slots(slot_out, top_k, adds, out_dtype)


ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # the gate/up kernel's ACT


# Columns and warps a combine program. (512|1024|2048, 4|8) all ran 23.1-25.4 us at 2048 tokens on the
# H200 (§21): the pass is at its memory time (8 slot rows + 2 addends + the output, ~92 MB: 22 us at 4.2 TB/s).
COMBINE_BLOCK, COMBINE_WARPS = 1024, 4


def combine_slots(slot_out: torch.Tensor, top_k: int, adds: tuple = (), out_dtype: torch.dtype | None = None,
                  shared_last: bool = False) -> torch.Tensor:
    """slot_out [T*K, H] -> [T, H]: the fp32 sum of each token's K slots rounded to out_dtype, plus
    `adds` in order (kernel 4). shared_last: slot K-1 is a shared expert's (routing weight 1), added
    after the rounded sum of the others and before `adds`, as `adds[0]` would be."""
    hidden = slot_out.shape[1]
    num_tokens = slot_out.shape[0] // top_k
    out_dtype = out_dtype or slot_out.dtype
    if len(adds) > 2:
        raise ValueError(f"fused_moe: at most two tensors in adds (got {len(adds)})")
    adds = tuple(a.to(out_dtype).contiguous() for a in adds)
    for a in adds:
        if a.shape != (num_tokens, hidden):
            raise ValueError(f"fused_moe: an addend of shape {tuple(a.shape)}, not {(num_tokens, hidden)}")
    out = torch.empty(num_tokens, hidden, dtype=out_dtype, device=slot_out.device)
    block = min(COMBINE_BLOCK, triton.next_power_of_2(hidden))
    first, second = (adds + (out, out))[:2]
    _combine_kernel[(num_tokens, triton.cdiv(hidden, block))](
        slot_out, first, second, out, hidden, TOPK=top_k, NUM_ADDS=len(adds), SHARED=int(shared_last), BLOCK=block,
        DT=_tl_dtype(out_dtype), num_warps=COMBINE_WARPS, **pdl_launch())
    return out


def _weight_tiles(w: torch.Tensor, block_n: int, block_k: int):
    """A TMA descriptor over the stacked expert weights as one [E*N, K] matrix, [block_n, block_k]
    tiles (host-side: a kernel argument by value, so a CUDA graph keeps it)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if not w.is_contiguous():
        raise ValueError("MoEConfig TMA1/TMA2: the expert weights must be contiguous for a TMA descriptor")
    if w.is_cuda and torch.cuda.get_device_capability(w.device)[0] < 9:
        raise ValueError("MoEConfig TMA1/TMA2: TMA needs sm90 or newer (Hopper); set them to 0 on this GPU")
    return TensorDescriptor.from_tensor(w.view(-1, w.shape[-1]), [block_n, block_k])


def gate_up_stage(x: torch.Tensor, w_gate_up: torch.Tensor, sorted_ids: torch.Tensor, expert_ids: torch.Tensor,
                  total: torch.Tensor, top_k: int, cfg: MoEConfig, activation: str = "silu") -> torch.Tensor:
    """act(gate) * up of every aligned row -> [rows, I] in x.dtype (kernel 1; a stage of its own so
    the tuner can time it alone); act: "silu" or "gelu_tanh"."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"fused_moe: activation {activation!r}; one of {sorted(ACTIVATIONS)}")
    num_tokens, hidden = x.shape
    inter = w_gate_up.shape[1] // 2
    bm = cfg.BLOCK_M
    num_pid_m = sorted_ids.numel() // bm
    inter_buf = torch.empty(sorted_ids.numel(), inter, dtype=x.dtype, device=x.device)
    grid = (num_pid_m * triton.cdiv(inter, cfg.BLOCK_N1),)
    _gate_up_kernel[grid](
        x, w_gate_up, _weight_tiles(w_gate_up, cfg.BLOCK_N1, cfg.BLOCK_K1) if cfg.TMA1 else None, inter_buf, sorted_ids, expert_ids, total,
        num_tokens * top_k, top_k, hidden, inter, num_pid_m,
        x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), w_gate_up.stride(2), inter_buf.stride(0),
        BLOCK_M=bm, BLOCK_N=cfg.BLOCK_N1, BLOCK_K=cfg.BLOCK_K1, GROUP_M=cfg.GROUP_M, SHRINK_M=cfg.SHRINK1,
        EVEN_K=hidden % cfg.BLOCK_K1 == 0, IEEE=x.dtype == torch.float32, TMA=bool(cfg.TMA1),
        ACT=ACTIVATIONS[activation], num_warps=cfg.WARPS1, num_stages=cfg.STAGES1, **pdl_launch())
    return inter_buf


def down_stage(inter_buf: torch.Tensor, w_down: torch.Tensor, topk_weight: torch.Tensor, sorted_ids: torch.Tensor,
               expert_ids: torch.Tensor, total: torch.Tensor, cfg: MoEConfig, foreign_slots: bool = False
               ) -> torch.Tensor:
    """Down projection times the routing weight -> [T*K, H] per token-slot (kernel 2)."""
    n = topk_weight.numel()
    _, hidden, inter = w_down.shape
    bm = cfg.BLOCK_M
    num_pid_m = sorted_ids.numel() // bm
    # Foreign slots are never written by the down kernel: they must read as zero in the combine.
    slot_out = (torch.zeros if foreign_slots else torch.empty)(n, hidden, dtype=inter_buf.dtype,
                                                                device=inter_buf.device)
    grid = (num_pid_m * triton.cdiv(hidden, cfg.BLOCK_N2),)
    _down_kernel[grid](
        inter_buf, w_down, _weight_tiles(w_down, cfg.BLOCK_N2, cfg.BLOCK_K2) if cfg.TMA2 else None, slot_out, topk_weight, sorted_ids, expert_ids, total,
        n, hidden, inter, num_pid_m,
        inter_buf.stride(0), w_down.stride(0), w_down.stride(1), w_down.stride(2), slot_out.stride(0),
        BLOCK_M=bm, BLOCK_N=cfg.BLOCK_N2, BLOCK_K=cfg.BLOCK_K2, GROUP_M=cfg.GROUP_M, SHRINK_M=cfg.SHRINK2,
        EVEN_K=inter % cfg.BLOCK_K2 == 0, IEEE=inter_buf.dtype == torch.float32, TMA=bool(cfg.TMA2),
        num_warps=cfg.WARPS2, num_stages=cfg.STAGES2, **pdl_launch())
    return slot_out


def grouped_mm_moe(x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor,
                   w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """`moe_forward`'s grouped-GEMM path without host syncs (CUDA bf16, sm90+).

    moe_forward uses `torch.bincount` (on CUDA it reads the max back to the host to size its output)
    and `out[order] = ...` (index_put); here counts come from scatter_add_ into a fixed-size buffer
    and the un-permute is a gather with the inverse permutation. Same arithmetic as moe_forward:
    bf16 grouped GEMMs, SiLU*up in bf16, weighted sum over slots in fp32."""
    num_tokens, top_k = topk_idx.shape
    num_experts = w_gate_up.shape[0]
    flat = topk_idx.reshape(-1)
    n = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat.long(), torch.ones(n, dtype=torch.int32, device=x.device))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    sorted_x = x.index_select(0, order // top_k)
    gate_up = torch._grouped_mm(sorted_x, w_gate_up.transpose(1, 2), offs=offs)
    gate, up = gate_up.chunk(2, dim=-1)
    sorted_out = torch._grouped_mm(F.silu(gate) * up, w_down.transpose(1, 2), offs=offs)
    inv = torch.empty_like(order)
    inv.scatter_(0, order, torch.arange(n, device=x.device, dtype=order.dtype))
    out = sorted_out.index_select(0, inv).view(num_tokens, top_k, -1)
    return (out.float() * topk_weight[..., None].float()).sum(dim=1).to(x.dtype)
