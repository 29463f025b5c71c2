"""Does programmatic dependent launch (PDL) shorten the gap between graph-replayed Triton kernels?

A chain of CHAIN row-norm kernels (each reads the previous one's output), captured in one CUDA graph,
replayed: us per kernel without PDL, with launch_pdl + gdc_wait first, and with gdc_launch_dependents
after the loads as well; the outputs must be equal bit for bit. A matmul between two kernels checks
that a PDL launch after a non-PDL kernel still waits for it. Run on the device: python3 benchmarks/device/pdl.py
"""
import torch
import triton
import triton.language as tl

CHAIN = 60


@triton.jit
def _norm(x_ptr, w_ptr, y_ptr, H: tl.constexpr, GDC: tl.constexpr, EARLY: tl.constexpr):
    row = tl.program_id(0)
    if GDC:
        tl.extra.cuda.gdc_wait()
    offs = tl.arange(0, H)
    x = tl.load(x_ptr + row * H + offs).to(tl.float32)
    w = tl.load(w_ptr + offs).to(tl.float32)
    if EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    y = x * tl.rsqrt(tl.sum(x * x) / H + 1e-6) * w + 0.001
    tl.store(y_ptr + row * H + offs, y.to(y_ptr.dtype.element_ty))


def chain(x, w, bufs, gdc, early, mm=None):
    src = x
    for i in range(CHAIN):
        dst = bufs[i % 2]
        _norm[(x.shape[0],)](src, w, dst, H=x.shape[1], GDC=gdc, EARLY=early, launch_pdl=gdc, num_warps=4)
        if mm is not None and i == CHAIN // 2:
            dst = dst @ mm  # a cuBLAS kernel in the chain: the next PDL launch must wait for it
        src = dst
    return src


def run(rows, gdc, early, mm=None):
    torch.manual_seed(0)
    x = torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, device="cuda", dtype=torch.bfloat16)
    bufs = [torch.empty_like(x) for _ in range(2)]
    for _ in range(2):
        chain(x, w, bufs, gdc, early, mm)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = chain(x, w, bufs, gdc, early, mm)
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return out.clone(), start.elapsed_time(end) / 50 / CHAIN * 1e3


def main():
    print("triton", triton.__version__, torch.cuda.get_device_name())
    mm = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16) / 45
    print("rows | variant | us/kernel | equal to plain")
    for rows in (32, 512, 2048, 8192):
        base, t0 = run(rows, False, False)
        print(f"{rows} | plain | {t0:.2f} | -")
        for name, gdc, early in (("pdl wait", True, False), ("pdl wait+early", True, True)):
            out, t = run(rows, gdc, early)
            print(f"{rows} | {name} | {t:.2f} | {torch.equal(out, base)}")
    base, _ = run(2048, False, False, mm)
    out, _ = run(2048, True, True, mm)
    print("with a matmul in the chain, pdl equal to plain:", torch.equal(out, base))


if __name__ == "__main__":
    main()
