"""The FP8 kernels' sm90 K loops without a GPU (kernels/fp8_gemm.py, kernels/fp8_moe.py): registers, spills, whether
Triton's pipeliner staged the loop's loads (shared-memory buffers with a stage dimension) and, in the SASS, the global
loads (LDG) an iteration issues between its barrier wait and its e4m3 MMA (QGMMA) wait. Before 2026-12-08 those were
the block's own scales, which the iteration then waited on (every column's weight scale at 64-wide tiles); since, the
next block's, loaded ahead (docs/benchmarks.md, "The FP8 kernels' scale loads").

Compiled as canvas_attention_sm90.py does (Triton's CUDA backend on the CPU machine; the launch's divisibility-by-16
specialization of the strides and sizes); the Triton here may not be the device image's (pip download triton==3.6.0).
Usage: python3 benchmarks/device/fp8_sm90.py [TREE] (TREE: a directory holding a fluxlab/, default this checkout; e.g.
`git archive 4c17449 fluxlab | tar -x -C DIR` for the loops before the prefetch)
"""
import importlib
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from canvas_attention_sm90 import HERE, compile_sm90, launch_signature  # noqa: E402

FP8_ARGS = {"xq_ptr", "w_ptr", "a_ptr"}  # e4m3 operands; the gate/up kernel's out_ptr too (its epilogue quantizes)


def loops(kernel, constexprs: dict, warps: int, stages: int, tma_rows: dict | None = None) -> str:
    """One line on `kernel`'s K loop for sm90: registers, stack, staged buffers, LDGs an iteration (module doc)."""
    def arg_type(name):
        if name.endswith("_desc"):
            return f"tensordesc<fp8e4nv[{tma_rows[name]}, 128]>"
        if name.endswith("_ptr"):
            e4m3 = name in FP8_ARGS or (name == "out_ptr" and kernel.fn.__name__ == "_fp8_gate_up_kernel")
            return ("*fp8e4nv" if e4m3 else "*i32" if "ids" in name or "total" in name else
                    "*bf16" if name == "out_ptr" else "*fp32")
        return None if name == "PDL" else "i32"

    signature, attrs = launch_signature(kernel, constexprs, arg_type, lambda name: name.endswith("_ptr") or (
        name.startswith("stride") or name in ("N", "K", "H", "I")))
    compiled, usage, sass = compile_sm90(kernel, signature, constexprs, attrs, warps, stages)
    reg, stack = re.search(r"REG:(\d+)", usage).group(1), re.search(r"STACK:(\d+)", usage).group(1)
    staged = len(re.findall(r"local_alloc : \(\) -> !ttg\.memdesc<\d+x", compiled.asm["ttgir"]))
    return f"REG {reg:>3}  STACK {stack:>4}  staged buffers {staged}  LDGs an iteration {loop_loads(sass)}"


def loop_loads(sass: str) -> int:
    """LDGs between the first barrier wait (TRYWAIT, or the first QGMMA on the pointer path) of the K loop's body and
    the MMA wait (WARPGROUP.DEPBAR) after it: the loads an iteration issues itself."""
    lines = [line for line in sass.splitlines() if line.strip().startswith("/*")]
    first = next((i for i, line in enumerate(lines) if "QGMMA" in line), None)
    if first is None:
        return -1
    wait = next(i for i in range(first, len(lines)) if "WARPGROUP.DEPBAR" in lines[i])
    start = max((i for i in range(first) if "TRYWAIT" in lines[i] or "BAR.SYNC" in lines[i]), default=0)
    return sum("LDG" in line for line in lines[start:wait])


def main(argv: list[str]) -> None:
    tree = argv[0] if argv else HERE
    sys.path.insert(0, tree)
    import triton
    import triton.language as tl

    gemm = importlib.import_module("fluxlab.kernels.fp8_gemm")
    moe = importlib.import_module("fluxlab.kernels.fp8_moe")
    print(f"tree {tree}; triton {triton.__version__}, target sm90")
    tiles = list(dict.fromkeys([(gemm.BLOCK_M, gemm.BLOCK_N, gemm.WARPS, gemm.STAGES), *gemm.NARROW_TILES.values(),
                                (gemm.BLOCK_M, gemm.WIDE_N, gemm.WARPS, gemm.WIDE_STAGES)]))
    for bm, bn, warps, stages in tiles:
        for tma in (False, True):
            consts = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=gemm.GROUP, GROUP_M=gemm.GROUP_M, EVEN_K=True, TMA=tma)
            if "WS" in gemm._fp8_gemm_kernel.arg_names:
                consts["WS"] = False
            if not tma:
                consts.update(x_desc=None, w_desc=None)
            line = loops(gemm._fp8_gemm_kernel, consts, warps, stages, {"x_desc": bm, "w_desc": bn})
            print(f"fp8 GEMM {bm}x{bn} w{warps} s{stages} {'tma     ' if tma else 'pointers'}: {line}")
    cfg = moe.FP8MoEConfig()
    act = dict(ACT=1, ROUND_DT=tl.bfloat16, INTERPRET=False)
    print(f"fp8 MoE gate/up {cfg.BLOCK_M}x{gemm.GROUP} w{cfg.WARPS1} s{cfg.STAGES1}: " + loops(
        moe._fp8_gate_up_kernel, dict(BLOCK_M=cfg.BLOCK_M, BLOCK_N=gemm.GROUP, BLOCK_K=gemm.GROUP,
                                      GROUP_M=cfg.GROUP_M, EVEN_K=True, **act), cfg.WARPS1, cfg.STAGES1))
    print(f"fp8 MoE down {cfg.BLOCK_M}x{cfg.BLOCK_N2} w{cfg.WARPS2} s{cfg.STAGES2}: " + loops(
        moe._fp8_down_kernel, dict(BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N2, BLOCK_K=gemm.GROUP,
                                   GROUP_M=cfg.GROUP_M, EVEN_K=False), cfg.WARPS2, cfg.STAGES2))


if __name__ == "__main__":
    main(sys.argv[1:])
