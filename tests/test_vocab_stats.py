"""The one-pass argmax + probability kernel against torch (max, softmax), on the Triton interpreter
on CPU and on the GPU with `-m gpu`."""
import importlib.util

import pytest
import torch
from triton_helpers import run_interpreter_checks

HAVE_TRITON = importlib.util.find_spec("triton") is not None


def _check(device: str, dtype: torch.dtype, rows: int, vocab: int) -> None:
    from fluxlab.kernels.vocab_stats import greedy_stats

    gen = torch.Generator().manual_seed(rows * 7 + vocab)
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(device, dtype)
    logits[0, vocab - 1] = 40.0  # the max in the last slice's tail
    if rows > 1:
        logits[1, 3] = 40.0  # ...and in the first block
    tokens, conf = greedy_stats(logits)
    probs = torch.softmax(logits.float(), dim=-1)
    want_conf, want_tokens = probs.max(dim=-1)
    assert torch.equal(tokens.cpu(), want_tokens.cpu()), (tokens, want_tokens)
    assert torch.allclose(conf.cpu(), want_conf.cpu(), rtol=1e-5, atol=1e-7), (conf, want_conf)
    assert tokens[0] == vocab - 1 and (rows == 1 or tokens[1] == 3)


def _interpreter_checks() -> None:
    for rows, vocab in ((1, 9000), (3, 4099), (5, 2048)):
        _check("cpu", torch.float32, rows, vocab)
    _check("cpu", torch.bfloat16, 2, 5000)
    # ties: the lowest index wins, as torch.max
    from fluxlab.kernels.vocab_stats import greedy_stats

    logits = torch.zeros(2, 9000)
    logits[:, [17, 8000]] = 5.0
    tokens, _ = greedy_stats(logits)
    assert tokens.tolist() == [17, 17]
    # -inf logits (banned tokens) before finite ones in the same lanes: no NaN leaks into the sum
    logits = torch.randn(2, 9000, generator=torch.Generator().manual_seed(2))
    logits[:, :3000] = float("-inf")
    tokens, conf = greedy_stats(logits)
    want_conf, want_tokens = torch.softmax(logits, dim=-1).max(dim=-1)
    assert torch.equal(tokens, want_tokens) and torch.allclose(conf, want_conf, rtol=1e-5), (conf, want_conf)
    print("interpreter checks ok")


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_kernel_under_the_triton_interpreter():
    run_interpreter_checks(__file__)


def test_torch_path_is_max_and_softmax_probability():
    from fluxlab.kernels.vocab_stats import greedy_torch

    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(1))
    tokens, conf = greedy_torch(logits)
    want_conf, want_tokens = torch.softmax(logits, dim=-1).max(dim=-1)
    assert torch.equal(tokens, want_tokens) and torch.allclose(conf, want_conf)


@pytest.mark.gpu
def test_kernel_on_gpu_matches_torch():
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    for rows, vocab in ((1, 157184), (32, 157184), (2048, 157184)):
        _check("cuda", torch.bfloat16, rows, vocab)
        _check("cuda", torch.float32, rows, vocab)


if __name__ == "__main__":
    _interpreter_checks()
