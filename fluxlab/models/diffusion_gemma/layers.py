"""Diffusion-Gemma (Gemma-4 text) layers: attention projections, dense MLP + routed experts.

Module names mirror transformers' `DiffusionGemma*TextLayer` (so checkpoint names map 1:1 after
the prefix), and each step follows transformers' order of operations so fp32 results agree to
rounding. The attention math itself lives behind `CanvasAttentionBackend` (diffusion_gemma_attention.py).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from fluxlab.engine.layers.fp8 import (BLOCK, fp8_linear, fp8_linears, fp8_moe, num_blocks, quantize_blocks,
                                       quantize_stacked)
from fluxlab.engine.layers.quantization import Fp8Linear
from fluxlab.kernels import gemma_norm  # CUDA bf16: the norms fused with their adds and RoPE
from fluxlab.kernels.invariant_matmul import linear  # CUDA bf16: batch-invariant (kernels/invariant_matmul.py)
from fluxlab.kernels.route_topk import softmax_topk_from_logits
from fluxlab.kernels.swiglu import gelu_tanh_mul


class GemmaRMSNorm(nn.Module):
    """Gemma-4 RMSNorm: x * (mean(x^2) + eps)^-1/2 in fp32, times `weight` (not 1 + weight)."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if gemma_norm.use_kernel(x):
            return gemma_norm.norm_rope(x, self.weight, self.eps)
        x32 = x.float()
        out = x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            out = out * self.weight.float()
        return out.type_as(x)


def project(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """A projection: nn.Linear's weight through the batch-invariant matmul; any other module (the
    `Fp8Linear` of model.quantization=fp8) computes itself."""
    return linear(x, layer.weight) if isinstance(layer, nn.Linear) else layer(x)


def project_all(x: torch.Tensor, *layers: nn.Module) -> list[torch.Tensor]:
    """`project` of one input by several layers; FP8 layers share one quantization of x on the GPU."""
    if all(isinstance(layer, Fp8Linear) for layer in layers):
        return fp8_linears(x, [(layer.weight, layer.weight_scale_inv) for layer in layers])
    return [project(x, layer) for layer in layers]


def fuse_linears(*layers: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """One weight [sum of N, K] whose row blocks the layers' weights become views of, and for `Fp8Linear`s
    one `weight_scale_inv` grid the same way; None where the layers cannot share one (mixed kinds; FP8
    layers whose rows are not whole 128-row blocks, so a block would hold two layers' rows under one
    scale). A matmul by it computes every layer's output at once, each element summed over K as its own
    layer's would be (the batch-invariant matmul's tiles change no output bit:
    benchmarks/device/diffusion_gemma_matmul_tiles.py; the FP8 GEMM reads an output column's own weight
    row and scale block). At one canvas (256 rows) q, k and v alone launch 64, 32 and 32 programs of
    128 x 128 on 132 SMs and each waits on its own K loop; fused they fill one wave (H200 sweep,
    2026-12-03: 32 + 29 + 29 us apart, 35 us for a weight of their fused shape)."""
    if all(type(layer) is nn.Linear for layer in layers):
        names = ("weight",)
    elif all(isinstance(layer, Fp8Linear) and layer.weight.shape[0] % BLOCK == 0 for layer in layers):
        names = ("weight", "weight_scale_inv")
    else:
        return None
    fused = []
    for name in names:
        whole = torch.cat([getattr(layer, name).detach() for layer in layers])
        start = 0
        for layer in layers:
            param = getattr(layer, name)
            rows = param.shape[0]
            param.data = whole[start:start + rows]
            start += rows
        fused.append(whole)
    return fused[0], (fused[1] if len(fused) > 1 else None)


def fused_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor | None) -> torch.Tensor:
    """x by a `fuse_linears` weight: the batch-invariant matmul, or the FP8 GEMM with its scales."""
    return linear(x, weight) if scale_inv is None else fp8_linear(x, weight, scale_inv)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotation over the whole head; proportional RoPE has cos=1, sin=0 on its unrotated dims."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class GemmaAttention(nn.Module):
    """q/k/v projections with per-head q/k RMSNorm and an unscaled v norm; softmax scale is 1.

    Full-attention layers have no v_proj: values are the k projection before k_norm/RoPE
    (Gemma-4's k_eq_v), so one projection feeds both.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                 has_v_proj: bool):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False) if has_v_proj else None
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.q_norm = GemmaRMSNorm(head_dim, eps)
        self.k_norm = GemmaRMSNorm(head_dim, eps)
        self.v_norm = GemmaRMSNorm(head_dim, eps, with_scale=False)
        self.qkv_weight: torch.Tensor | None = None  # fuse_projections_: q, k (and v) rows of one weight
        self.qkv_scale_inv: torch.Tensor | None = None  # and their FP8 scale blocks (model.quantization=fp8)
        self.qkv_sizes: list[int] = []  # its row blocks, in that order

    def projections(self) -> list[nn.Module]:
        return [self.q_proj, self.k_proj] + ([self.v_proj] if self.v_proj is not None else [])

    def fuse_projections_(self) -> None:
        projections = self.projections()
        fused = fuse_linears(*projections)
        if fused is not None:
            self.qkv_sizes = [layer.weight.shape[0] for layer in projections]
            self.qkv_weight, self.qkv_scale_inv = fused

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        n = x.shape[0]
        if self.qkv_weight is not None:
            q, k_raw, *v = fused_linear(x, self.qkv_weight, self.qkv_scale_inv).split(self.qkv_sizes, dim=-1)
        else:
            q, k_raw, *v = project_all(x, *self.projections())
        q = q.view(n, self.num_heads, self.head_dim)
        k_raw = k_raw.view(n, self.num_kv_heads, self.head_dim)
        v_raw = v[0].view(n, self.num_kv_heads, self.head_dim) if v else k_raw
        if gemma_norm.use_kernel(x):  # norm + rotation in one pass a tensor
            return (gemma_norm.norm_rope(q, self.q_norm.weight, self.q_norm.eps, cos, sin),
                    gemma_norm.norm_rope(k_raw, self.k_norm.weight, self.k_norm.eps, cos, sin),
                    gemma_norm.norm_rope(v_raw, None, self.v_norm.eps))
        return rotate(self.q_norm(q), cos, sin), rotate(self.k_norm(k_raw), cos, sin), self.v_norm(v_raw)


class GemmaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up_weight: torch.Tensor | None = None  # fuse_projections_: gate and up rows of one weight
        self.gate_up_scale_inv: torch.Tensor | None = None  # and their FP8 scale blocks (whole blocks only)

    def fuse_projections_(self) -> None:
        fused = fuse_linears(self.gate_proj, self.up_proj)
        if fused is not None:
            self.gate_up_weight, self.gate_up_scale_inv = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is not None:
            gate, up = fused_linear(x, self.gate_up_weight, self.gate_up_scale_inv).chunk(2, dim=-1)
        else:
            gate, up = project_all(x, self.gate_proj, self.up_proj)
        if _fused_ok(gate):  # one pass (kernels/swiglu.py); fp32 and CPU keep torch's two ops
            n = gate.shape[-1]
            return project(gelu_tanh_mul(gate.reshape(-1, n), up.reshape(-1, n)).view(gate.shape), self.down_proj)
        return project(F.gelu(gate, approximate="tanh") * up, self.down_proj)


class GemmaRouter(nn.Module):
    """Softmax over experts of an unscaled-RMSNorm'd, `scale`-weighted input; top-k renormalised,
    then multiplied by a learned per-expert scale."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, eps: float):
        super().__init__()
        self.top_k = top_k
        self.norm = GemmaRMSNorm(hidden_size, eps, with_scale=False)
        self.proj = nn.Linear(hidden_size, num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts))
        self.root_size = hidden_size ** -0.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.route(self.norm(x) * self.scale * self.root_size)

    def route(self, scaled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, experts) from the scaled, normed input (`forward`'s, or gemma_norm.attn_residual's)."""
        if scaled.is_cuda:
            scores = linear(scaled, self.proj.weight)
        else:  # float64 sums: a 1-token row alone takes torch's CPU gemv, which rounds otherwise than
            # the same row in a batch; FP8 layers downstream would turn that ulp into a moved e4m3 code
            scores = (scaled.double() @ self.proj.weight.double().t()).to(scaled.dtype)
        if _fused_ok(scores):  # the ops below in one program a token (kernels/route_topk.py); fp32 and CPU keep them
            return softmax_topk_from_logits(scores, self.top_k, self.per_expert_scale)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        weights, index = torch.topk(probs, k=self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[index], index


class GemmaExperts(nn.Module):
    """Routed experts stored as transformers stores them: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor,
                static: bool = False) -> torch.Tensor:
        """static: no host sync and no data-dependent shape (a CUDA graph holds the forward)."""
        if _fused_ok(x):
            return self._fused(x, weights, index)
        if static:
            return self._every_expert(x, weights, index)
        out = torch.zeros_like(x)
        for expert in index.unique().tolist():
            token, slot = torch.where(index == expert)
            gate, up = F.linear(x[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.gelu(gate, approximate="tanh") * up, self.down_proj[expert])
            out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
        return out

    def _fused(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """CUDA bf16/fp16: the fused Triton MoE with gelu-tanh (sync-free, graph-capturable). Sums in
        another order than transformers' loop (fp32 over the slots, rounded once), so bf16 rounding
        differs; fp32 parity uses the loop. The tile config follows the token count only in what leaves a
        token's bits alone (`canvas_moe_config`)."""
        from fluxlab.kernels.fused_moe import fused_moe

        return fused_moe(x, index, weights, self.gate_up_proj, self.down_proj,
                         config=canvas_moe_config(x.shape[0]), activation="gelu_tanh")

    def _every_expert(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The loop's sums with static shapes: every expert runs on every token and adds its output
        times the token's weight for it, 0 where not routed (adding y * 0 changes no sum), in the
        loop's order (ascending expert id). Costs num_experts / top_k times the loop's FLOPs: for the
        fp32 and CPU static path, not for speed."""
        out = torch.zeros_like(x)
        for expert in range(self.gate_up_proj.shape[0]):
            weight = (weights * (index == expert)).sum(dim=-1)  # one nonzero term at most
            gate, up = F.linear(x, self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.gelu(gate, approximate="tanh") * up, self.down_proj[expert])
            out += (y * weight[:, None]).to(out.dtype)
        return out


class Fp8GemmaExperts(nn.Module):
    """`GemmaExperts` with e4m3 weights (model.quantization=fp8), named as the checkpoint names them plus
    `_scale_inv`: gate_up_proj [E, 2I, H] with gate_up_proj_scale_inv [E, 2*ceil(I/128), ceil(H/128)]
    (a 128x128 grid for the gate half, then one for the up half: the 26B-A4B's I = 704 = 5.5 x 128
    would otherwise put gate and up rows in one block), down_proj [E, H, I] with down_proj_scale_inv
    [E, ceil(H/128), ceil(I/128)]. CUDA: the FP8 fused MoE with gelu-tanh (kernels/fp8_moe.py: one
    tile config, sync-free, so static and batch invariant); CPU: its dequantize reference."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, device=None):
        super().__init__()
        e, h, i = num_experts, hidden_size, intermediate_size
        self.gate_up_proj = _frozen(torch.empty(e, 2 * i, h, dtype=torch.float8_e4m3fn, device=device))
        self.gate_up_proj_scale_inv = _frozen(torch.empty(e, 2 * num_blocks(i), num_blocks(h), device=device))
        self.down_proj = _frozen(torch.empty(e, h, i, dtype=torch.float8_e4m3fn, device=device))
        self.down_proj_scale_inv = _frozen(torch.empty(e, num_blocks(h), num_blocks(i), device=device))

    @classmethod
    @torch.no_grad()
    def quantized(cls, experts: GemmaExperts) -> "Fp8GemmaExperts":
        e, two_i, h = experts.gate_up_proj.shape
        fp8 = cls(e, h, two_i // 2, device="meta")
        q, s = quantize_stacked(experts.gate_up_proj.data, 2)
        fp8.gate_up_proj, fp8.gate_up_proj_scale_inv = _frozen(q), _frozen(s)
        q, s = quantize_blocks(experts.down_proj.data)
        fp8.down_proj, fp8.down_proj_scale_inv = _frozen(q), _frozen(s)
        return fp8

    def forward(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor,
                static: bool = False) -> torch.Tensor:
        """static needs nothing more: the kernel is sync-free (the CPU reference, never in a graph, is not)."""
        return fp8_moe(x, index, weights, self.gate_up_proj, self.gate_up_proj_scale_inv, self.down_proj,
                       self.down_proj_scale_inv, activation="gelu_tanh")


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def _fused_ok(x: torch.Tensor) -> bool:
    """CUDA bf16/fp16 with triton: where this file's Triton kernels (MoE, router, GeGLU) replace torch ops."""
    from fluxlab.kernels.fused_moe import HAVE_TRITON

    return HAVE_TRITON and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)


def canvas_moe_config(tokens: int):
    """The fused MoE's tile config for `tokens` tokens. 26B-A4B: H=2816 = 22 x 128, I=704 = 11 x 64.
    BLOCK_M 64 shrinking to 32/16 rows keeps the weight reads of a canvas (~16 rows an expert) near one
    pass. More canvases take taller, narrower-K tiles. Batch invariance: a token's bits must not depend on
    the config its batch gets; on an H200 (2026-12-04, benchmarks/device/diffusion_gemma_moe_tiles.py)
    every candidate gave a canvas inside 1024 and 4096 tokens the bits of that canvas alone, and the
    GPU test (tests/test_gpu_diffusion_gemma_invariance.py, 1/8/64 canvases) crosses all three configs.
    ms a layer at 256 / 1024 / 4096 tokens, the one config before: 0.415 / 0.510 / 1.259; these: 0.405,
    0.478, 1.106. FLUXLAB_FUSED_MOE_CONFIG overrides fields (device sweeps)."""
    import dataclasses
    import json
    import os

    from fluxlab.kernels.moe_config import MoEConfig

    cfg = MoEConfig(BLOCK_M=64, BLOCK_N1=64, BLOCK_K1=128, WARPS1=4, STAGES1=4, BLOCK_N2=128, BLOCK_K2=64,
                    WARPS2=4, STAGES2=4, GROUP_M=8, SHRINK1=2, SHRINK2=2)
    if tokens > 2048:
        cfg = dataclasses.replace(cfg, BLOCK_M=128, SHRINK1=1, SHRINK2=1, BLOCK_N1=128, BLOCK_K1=64, WARPS1=8,
                                  STAGES1=3, WARPS2=8, STAGES2=3)
    elif tokens > 512:
        cfg = dataclasses.replace(cfg, BLOCK_K1=64, STAGES2=3)
    env = os.environ.get("FLUXLAB_FUSED_MOE_CONFIG")
    return dataclasses.replace(cfg, **json.loads(env)) if env else cfg


class GemmaDecoderLayer(nn.Module):
    """Attention, then a dense MLP and routed experts side by side (each with its own norms), summed."""

    def __init__(self, layer_idx: int, hidden_size: int, intermediate_size: int, num_heads: int,
                 num_kv_heads: int, head_dim: int, is_sliding: bool, num_experts: int, top_k: int,
                 moe_intermediate_size: int, eps: float):
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = GemmaAttention(hidden_size, num_heads, num_kv_heads, head_dim, eps, has_v_proj=is_sliding)
        self.mlp = GemmaMLP(hidden_size, intermediate_size)
        for name in ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                     "pre_feedforward_layernorm_2"]:
            setattr(self, name, GemmaRMSNorm(hidden_size, eps))
        self.router = GemmaRouter(hidden_size, num_experts, top_k, eps)
        self.experts = GemmaExperts(num_experts, hidden_size, moe_intermediate_size)
        # transformers ties every encoder/decoder text weight except this buffer: one per pass.
        self.register_buffer("layer_scalar", torch.ones(1))  # canvas (decoder) pass
        self.register_buffer("encoder_layer_scalar", torch.ones(1))  # encoder pass
        self.side_stream: torch.cuda.Stream | None = None  # DiffusionGemmaModel.dense_beside_experts_
        self.side_max_tokens = 0

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn,
                encoder: bool | torch.Tensor, static: bool = False,
                twin: "GemmaDecoderLayer | None" = None) -> torch.Tensor:
        """encoder: this pass (True: encoder) or, in a mixed forward, a per-token mask. twin: the
        encoder's own weights when the checkpoint does not tie them to the decoder's
        (tie_word_embeddings=false); a mixed forward then runs both weight sets on every token and
        keeps each token's own (exact per token; twice the FLOPs outside attention)."""
        if twin is None or not isinstance(encoder, torch.Tensor):
            layer = twin if twin is not None and encoder else self
            o = attn.forward(self.layer_idx, *layer.qkv(x, cos, sin))
            return layer.feed_forward(x, o, static, self.scalar(encoder))
        mask = encoder[:, None, None]
        q, k, v = (torch.where(mask, e, d) for e, d in zip(twin.qkv(x, cos, sin), self.qkv(x, cos, sin)))
        o = attn.forward(self.layer_idx, q, k, v)
        out = torch.where(encoder[:, None], twin.feed_forward(x, o, static), self.feed_forward(x, o, static))
        return out * self.scalar(encoder)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        return self.self_attn.qkv(self.input_layernorm(x), cos, sin)

    def feed_forward(self, x: torch.Tensor, o: torch.Tensor, static: bool,
                     scalar: torch.Tensor | None = None) -> torch.Tensor:
        """The rest of the layer after attention (output `o`), times `scalar` (the layer scalar) if given."""
        attn_out = project(o.reshape(x.shape[0], -1), self.self_attn.o_proj)
        if gemma_norm.use_kernel(x) and (scalar is None or scalar.dtype == x.dtype):
            return self._fused_feed_forward(x, attn_out, static, scalar)
        x = x + self.post_attention_layernorm(attn_out)
        dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(x)))
        weights, index = self.router(x)  # routing reads the un-normed residual, as transformers does
        routed = self.post_feedforward_layernorm_2(self.experts(self.pre_feedforward_layernorm_2(x), weights, index,
                                                                 static))
        out = x + self.post_feedforward_layernorm(dense + routed)
        return out if scalar is None else out * scalar

    def _fused_feed_forward(self, x: torch.Tensor, attn_out: torch.Tensor, static: bool,
                            scalar: torch.Tensor | None) -> torch.Tensor:
        """`feed_forward`'s norms, adds and scalar in two kernels (kernels/gemma_norm.py), same ops."""
        eps = self.post_attention_layernorm.eps
        x, dense_in, experts_in, router_in = gemma_norm.attn_residual(
            attn_out, x, self.post_attention_layernorm.weight, self.pre_feedforward_layernorm.weight,
            self.pre_feedforward_layernorm_2.weight, self.router.scale, self.router.root_size, eps)
        side = self.side_stream if x.shape[0] <= self.side_max_tokens else None
        if side is not None:  # the dense MLP on its own stream, from here to the join below
            side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            dense = self.mlp(dense_in)
        weights, index = self.router.route(router_in)
        routed = self.experts(experts_in, weights, index, static)
        if side is not None:
            torch.cuda.current_stream(x.device).wait_stream(side)
        if scalar is None:
            scalar = torch.ones(1, dtype=x.dtype, device=x.device)
        return gemma_norm.ffn_residual(dense, routed, x, self.post_feedforward_layernorm_1.weight,
                                       self.post_feedforward_layernorm_2.weight, self.post_feedforward_layernorm.weight,
                                       scalar, eps)

    def scalar(self, encoder: bool | torch.Tensor) -> torch.Tensor:
        """The pass's layer scalar (both live on the decoder's layer, tied or not)."""
        if isinstance(encoder, torch.Tensor):  # a mixed forward: per token, True = encoder pass
            return torch.where(encoder[:, None], self.encoder_layer_scalar, self.layer_scalar)
        return self.encoder_layer_scalar if encoder else self.layer_scalar
