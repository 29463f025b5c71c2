import os

import torch
from torch import nn

# Fused Triton kernels (fluxlab/kernels/fused_norm.py) for bf16/fp16 on CUDA; fp32 keeps the torch
# path bit for bit. FLUXLAB_FUSED_KERNELS=0 turns them off.
_FUSED = os.environ.get("FLUXLAB_FUSED_KERNELS", "1") != "0"


def use_fused(x: torch.Tensor) -> bool:
    """Whether x takes the fused kernels: bf16/fp16 on CUDA, and not in a graph autograd records
    (the kernels have no backward: training under bf16 autocast keeps the torch ops)."""
    return (_FUSED and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and not (x.requires_grad and torch.is_grad_enabled()))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Published order (LLaDA2MoeRMSNorm): normalise in fp32, cast back to the input dtype,
    # then multiply by the weight. In bf16 this differs from weighting before the cast.
    if use_fused(x) and weight.dtype == x.dtype:
        from fluxlab.kernels.fused_norm import rms_norm as fused_rms_norm

        return fused_rms_norm(x, weight, eps)
    input_dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(input_dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
