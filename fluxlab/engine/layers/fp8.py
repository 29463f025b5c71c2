"""Block-scaled FP8 weights (the DeepSeek-V3 / Qwen3-FP8 layout) and the CPU reference path.

Layout, as the published FP8 checkpoints store it: a weight [N, K] is `weight` (float8_e4m3fn) plus
`weight_scale_inv` (float32, [ceil(N/128), ceil(K/128)]), and its value is
`weight[n, k] * weight_scale_inv[n // 128, k // 128]` ("inv": the factor that undoes the
quantizer's division). Quantizing a block divides by amax(|block|) / 448, e4m3's largest finite value.
Activations are quantized at run time per token and 128-wide group of the reduction dimension, the
same way (DeepSeek's `act_quant`, vLLM/SGLang's `per_token_group_quant_fp8`): amax = max(|x|, 1e-10),
s = amax / 448, q = clamp(x * (448 / amax), -448, 448) rounded to nearest even, all in fp32 (a
multiply by one reciprocal a group rather than a division an element: the kernels' arithmetic).

Stacked experts keep one scale grid per stacked piece: w_gate_up [E, 2I, H] has scales
[E, 2 * ceil(I/128), ceil(H/128)], gate blocks then up blocks, so no 128-row block mixes the two
whatever I is (the tiny models' I is below 128).

The CPU path is `fp8_linear_reference` / `fp8_moe_reference`: the activations quantized and
dequantized exactly as the GPU kernels quantize them, the weights dequantized, one matmul, rounded to
the activation dtype where the kernels round. It gives the GPU kernels' numbers up to the order of the
sums (tests/test_fp8_kernels.py checks the two under the Triton interpreter). The matmul multiplies
the fp32 operands in float64 (`dequantized_matmul`): their products are exact there and the sum's
rounding sits ~2**-29 below fp32's, so the fp32 result does not depend on how the CPU blocks the
product. An fp32 CPU GEMM does: one row alone takes a gemv whose sums round differently from the
same row among others, and with FP8 that matters, since an ulp moved before the next quantization
moves an e4m3 code in 1 of ~10**6 values, enough to change a sampled token. In float64 the CPU path
is batch invariant, as the kernels are.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128       # weight blocks are BLOCK x BLOCK; activation groups are BLOCK wide
ACT_EPS = 1e-10   # the smallest activation amax a group's scale is taken from (an all-zero group)


def num_blocks(n: int) -> int:
    return -(-n // BLOCK)


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (e4m3 [..., N, K], weight_scale_inv fp32 [..., ceil(N/128), ceil(K/128)]).

    Each 128x128 block is divided by amax/448 in fp32; an all-zero block gets scale 1."""
    *lead, n, k = w.shape
    nb, kb = num_blocks(n), num_blocks(k)
    padded = F.pad(w.float(), (0, kb * BLOCK - k, 0, nb * BLOCK - n))
    blocks = padded.view(*lead, nb, BLOCK, kb, BLOCK)
    amax = blocks.abs().amax(dim=(-3, -1))                             # [..., nb, kb]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.view(*lead, nb * BLOCK, kb * BLOCK)[..., :n, :k].contiguous()
    return q, scale.contiguous()


def dequantize_blocks(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of `quantize_blocks`: q [..., N, K] times its block's scale, in fp32, cast to dtype."""
    n, k = q.shape[-2:]
    s = scale_inv.repeat_interleave(BLOCK, dim=-2)[..., :n, :].repeat_interleave(BLOCK, dim=-1)[..., :k]
    return (q.float() * s).to(dtype)


def quantize_stacked(w: torch.Tensor, pieces: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, pieces * N, K] (stacked expert weights, e.g. gate then up) -> e4m3 [E, pieces*N, K] and
    scales [E, pieces * ceil(N/128), ceil(K/128)]: each piece quantized on its own block grid."""
    qs, ss = zip(*(quantize_blocks(part) for part in w.chunk(pieces, dim=-2)))
    return torch.cat(qs, dim=-2), torch.cat(ss, dim=-2)


def dequantize_stacked(q: torch.Tensor, scale_inv: torch.Tensor, pieces: int,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.cat([dequantize_blocks(a, b, dtype) for a, b in zip(q.chunk(pieces, dim=-2),
                                                                      scale_inv.chunk(pieces, dim=-2))], dim=-2)


def quantize_token_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], scales fp32 [M, ceil(K/128)]), per token and 128-wide group,
    with the GPU kernels' arithmetic (module doc)."""
    m, k = x.shape
    kb = num_blocks(k)
    groups = F.pad(x.float(), (0, kb * BLOCK - k)).view(m, kb, BLOCK)
    amax = groups.abs().amax(dim=-1).clamp(min=ACT_EPS)
    scale = amax / FP8_MAX
    q = (groups * (FP8_MAX / amax)[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, kb * BLOCK)[:, :k].contiguous(), scale


def fake_quantize_token_groups(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> the fp32 values the kernels multiply: quantized per token group, dequantized."""
    flat = x.reshape(-1, x.shape[-1])
    q, s = quantize_token_groups(flat)
    return dequantize_blocks_rows(q, s).view(*x.shape)


def dequantize_blocks_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per-row group scales [M, ceil(K/128)] applied to q [M, K] (fp32)."""
    return q.float() * scale.repeat_interleave(BLOCK, dim=-1)[:, :q.shape[-1]]


def dequantized_matmul(xq: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """xq [M, K] @ w [N, K].T of fp32 dequantized values, in float64, rounded once to fp32 (module doc:
    a row's result does not depend on the other rows)."""
    return (xq.double() @ w.double().t()).float()


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] @ dequant(weight [N, K]).T with x quantized per token group, the result rounded once
    to out_dtype (default x.dtype), as the GPU kernel's epilogue rounds it."""
    xq = fake_quantize_token_groups(x).reshape(-1, x.shape[-1])
    y = dequantized_matmul(xq, dequantize_blocks(weight, scale_inv))
    return y.to(out_dtype or x.dtype).view(*x.shape[:-1], weight.shape[0])


def use_fp8_kernel(x: torch.Tensor) -> bool:
    """CUDA activations take the Triton kernels (kernels/fp8_gemm.py, kernels/fp8_moe.py); CPU the reference."""
    from fluxlab.kernels.fp8_gemm import HAVE_TRITON, _interpret

    return HAVE_TRITON and (x.is_cuda or _interpret())


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """F.linear with an FP8 block-scaled weight (any leading dims of x)."""
    if not use_fp8_kernel(x):
        return fp8_linear_reference(x, weight, scale_inv, out_dtype)
    from fluxlab.kernels.fp8_gemm import fp8_matmul

    y = fp8_matmul(x.reshape(-1, x.shape[-1]), weight, scale_inv, out_dtype)
    return y.view(*x.shape[:-1], weight.shape[0])


def fp8_linears(x: torch.Tensor, weights: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    """`fp8_linear` of one input with several weights (q/k/v, gate/up): on the kernel path x is
    quantized once and the pair shared; the numbers are those of separate `fp8_linear` calls."""
    if not use_fp8_kernel(x):
        return [fp8_linear_reference(x, w, s) for w, s in weights]
    from fluxlab.kernels.fp8_gemm import fp8_matmul, quantize_act

    pair = quantize_act(x.reshape(-1, x.shape[-1]))
    return [fp8_matmul(pair, w, s, x.dtype).view(*x.shape[:-1], w.shape[0]) for w, s in weights]


def fp8_moe_reference(x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor,
                      w_gate_up: torch.Tensor, s_gate_up: torch.Tensor, w_down: torch.Tensor, s_down: torch.Tensor,
                      adds: tuple = (), activation: str = "silu", shared_last: bool = False) -> torch.Tensor:
    """The fused FP8 MoE's definition, expert by expert: x quantized per token group, gate and up to
    fp32, act(gate) * up rounded to x.dtype (the kernel's intermediate), quantized per token group,
    down to fp32 times the routing weight rounded to x.dtype (a slot), the K slots summed in fp32 and
    rounded, then `adds` added in order as torch adds them. Ids outside [0, E) add nothing. The
    products are `dequantized_matmul`s: an expert's rows do not depend on which others it got.
    shared_last: the last slot (a shared expert's) is left out of the sum and added before `adds`."""
    if activation not in ("silu", "gelu_tanh"):
        raise ValueError(f"fp8_moe_reference: activation {activation!r}; one of gelu_tanh, silu")
    num_tokens, top_k = topk_idx.shape
    num_experts = w_gate_up.shape[0]
    dt = x.dtype
    xq = fake_quantize_token_groups(x)
    slots = torch.zeros(num_tokens, top_k, x.shape[-1], dtype=dt, device=x.device)
    for e in torch.unique(topk_idx).tolist():
        if not 0 <= e < num_experts:
            continue
        tok, slot = (topk_idx == e).nonzero(as_tuple=True)
        gate, up = dequantized_matmul(xq[tok], dequantize_stacked(w_gate_up[e], s_gate_up[e], 2)).chunk(2, dim=-1)
        act = F.gelu(gate, approximate="tanh") if activation == "gelu_tanh" else F.silu(gate)
        inter = fake_quantize_token_groups((act * up).to(dt))
        down = dequantized_matmul(inter, dequantize_blocks(w_down[e], s_down[e]))
        slots[tok, slot] = (down * topk_weight[tok, slot].float()[:, None]).to(dt)
    routed = slots[:, :-1] if shared_last else slots
    y = routed.float().sum(dim=1).to(dt)
    for a in ((slots[:, -1],) if shared_last else ()) + tuple(adds):
        y = y + a
    return y


def fp8_moe(x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, w_gate_up: torch.Tensor,
            s_gate_up: torch.Tensor, w_down: torch.Tensor, s_down: torch.Tensor, adds: tuple = (),
            activation: str = "silu", config=None, shared_last: bool = False) -> torch.Tensor:
    """The FP8 routed experts: CUDA (or the interpreter) the Triton fused MoE, CPU its reference.
    config: the kernel's FP8MoEConfig (one per model, never per batch: batch invariance);
    shared_last: the last slot is a shared expert's (`fp8_moe_reference`)."""
    args = (x, topk_idx, topk_weight, w_gate_up, s_gate_up, w_down, s_down)
    if use_fp8_kernel(x):
        from fluxlab.kernels.fp8_moe import fp8_fused_moe

        return fp8_fused_moe(*args, config=config, adds=adds, activation=activation, shared_last=shared_last)
    return fp8_moe_reference(*args, adds=adds, activation=activation, shared_last=shared_last)
