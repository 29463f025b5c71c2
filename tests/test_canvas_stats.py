"""The canvas sampler's CUDA statistics kernel (argmax, entropy, probabilities of the soft-capped,
temperature-scaled raw logits) against the torch ops the CPU path runs.

CPU: the kernels run under the Triton interpreter (TRITON_INTERPRET=1) in a subprocess, as in
tests/test_fused_moe.py. GPU (`-m gpu`): the 26B-A4B vocabulary (262144) in bf16, and a denoising
step through the kernel vs through the torch ops.
"""
import importlib.util

import pytest
import torch
from triton_helpers import run_interpreter_checks

HAVE_TRITON = importlib.util.find_spec("triton") is not None


def reference(raw: torch.Tensor, temperature: torch.Tensor, softcap, noise: torch.Tensor):
    x = raw.float()
    if softcap:
        x = torch.tanh(x / softcap) * softcap
    x = x / temperature[:, None]
    entropy = torch.distributions.Categorical(logits=x, validate_args=False).entropy()
    probs = torch.softmax(x, -1)
    return x.argmax(-1), entropy, probs, (probs / noise).argmax(-1)


def check(raw: torch.Tensor, temperature: torch.Tensor, softcap, sample_mismatches: int = 0) -> None:
    from fluxlab.kernels.canvas_stats import canvas_stats

    noise = torch.empty(raw.shape, dtype=torch.float32, device=raw.device).exponential_(1)
    argmax, entropy, probs, sample = canvas_stats(raw, temperature, softcap, noise, raw.dtype)
    want_argmax, want_entropy, want_probs, want_sample = reference(raw, temperature, softcap, noise)
    assert torch.equal(argmax.cpu(), want_argmax.cpu())
    # a draw differs only where the two largest p / q agree to the kernel's rounding of p
    # (~1e-5 relative on GPU: exp, tanh from exp): about one row in 10^5
    assert int((sample != want_sample).sum()) <= sample_mismatches
    torch.testing.assert_close(entropy, want_entropy, rtol=2e-4, atol=2e-5)
    assert probs.dtype == raw.dtype
    if raw.dtype == torch.float32:
        torch.testing.assert_close(probs, want_probs, rtol=1e-4, atol=1e-7)
    else:  # the model dtype: within its rounding of the fp32 probabilities
        torch.testing.assert_close(probs.float(), want_probs.to(raw.dtype).float(), rtol=1e-2, atol=1e-6)


def _interpreter_checks() -> None:
    g = torch.Generator().manual_seed(0)
    for rows, vocab, softcap, dtype in ((5, 3000, 30.0, torch.float32), (3, 9000, None, torch.float32),
                                        (4, 5000, 30.0, torch.bfloat16)):
        raw = (torch.randn(rows, vocab, generator=g) * 8).to(dtype)
        raw[1, 17] = 90.0  # one confident row: entropy near 0, where lse - E[x] would cancel
        temperature = torch.rand(rows, generator=g) * 0.6 + 0.4
        check(raw, temperature, softcap)
    check_rows_do_not_depend_on_the_batch(3000, torch.float32, g)
    print("interpreter checks ok")


def check_rows_do_not_depend_on_the_batch(vocab: int, dtype: torch.dtype, g, rows: tuple = (1, 4, 11)) -> None:
    """Batch invariance: each row's four results are the same bits whatever rows share the call."""
    from fluxlab.kernels.canvas_stats import canvas_stats

    device = g.device
    n = max(rows)
    raw = (torch.randn(n, vocab, generator=g, device=device) * 6).to(dtype)
    temperature = torch.rand(n, generator=g, device=device) * 0.4 + 0.4
    noise = torch.empty(n, vocab, device=device).exponential_(1, generator=g)
    alone = [canvas_stats(raw[:1], temperature[:1], 30.0, noise[:1], dtype)]
    for r in rows[1:]:  # row 0 inside batches of r rows
        alone.append(tuple(t[:1] for t in canvas_stats(raw[:r], temperature[:r], 30.0, noise[:r], dtype)))
    for other in alone[1:]:
        assert all(torch.equal(a, b) for a, b in zip(alone[0], other))


@pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed (the CPU check runs it under TRITON_INTERPRET=1)")
def test_canvas_stats_match_the_torch_ops_interpreter():
    run_interpreter_checks(__file__)


def _cuda() -> bool:
    return HAVE_TRITON and torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU and triton")
def test_canvas_stats_on_the_26b_vocabulary():
    g = torch.Generator(device="cuda").manual_seed(0)
    raw = (torch.randn(512, 262144, generator=g, device="cuda") * 4).to(torch.bfloat16)
    temperature = torch.rand(512, generator=g, device="cuda") * 0.4 + 0.4
    check(raw, temperature, 30.0, sample_mismatches=2)
    # the runner calls it with up to 4 canvases (1024 positions)
    check_rows_do_not_depend_on_the_batch(262144, torch.bfloat16, g, rows=(1, 256, 1024))


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU and triton")
def test_denoise_step_through_the_kernel_matches_the_torch_ops():
    """Same raw logits, same generators: the kernel path and the torch path accept the same
    positions and draw the same noise (probabilities within fp32 rounding)."""
    from fluxlab.models.diffusion_gemma.decoding import CanvasStepInputs, denoise_step

    R, L, V, device = 3, 16, 4096, torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(1)
    raw = (torch.randn(R, L, V, generator=g, device=device) * 6).to(torch.bfloat16)
    inputs = CanvasStepInputs(torch.tensor([0.8, 0.6, 0.4], device=device), torch.full((R,), 2.0, device=device),
                              torch.full((R,), 1e-3, device=device), torch.ones(R, dtype=torch.long, device=device),
                              torch.zeros(R, dtype=torch.bool, device=device),
                              torch.full((R, L), -1, dtype=torch.long, device=device),
                              torch.zeros(R, dtype=torch.long, device=device))
    current = torch.zeros(R, L, dtype=torch.long, device=device)
    steps = []
    for kernel in (True, False):
        generators = [torch.Generator(device=device).manual_seed(s) for s in range(R)]
        import fluxlab.kernels.canvas_stats as cs
        real = cs.use_kernel
        cs.use_kernel = (lambda t: True) if kernel else (lambda t: False)
        try:
            steps.append(denoise_step(raw.clone(), current, inputs, generators, inplace=True, raw=True, softcap=30.0))
        finally:
            cs.use_kernel = real
    fused, torch_ops = steps
    assert fused.processed is None and torch_ops.processed is not None
    assert torch.equal(fused.argmax, torch_ops.argmax) and torch.equal(fused.accepted, torch_ops.accepted)
    torch.testing.assert_close(fused.probs.float(), torch_ops.probs, rtol=1e-2, atol=1e-6)  # bf16 vs fp32
    assert (fused.block == torch_ops.block).float().mean() > 0.95  # a multinomial draw may land on a rounding edge


if __name__ == "__main__":
    _interpreter_checks()
