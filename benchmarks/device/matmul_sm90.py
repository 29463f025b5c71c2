"""The batch-invariant matmul's sm90 resources without a GPU (kernels/invariant_matmul.py): registers, stack (spills),
shared memory and SASS instructions of each launch path at a tile.

Paths: `pointers` (eager calls: `_matmul_kernel` with pointer loads), `tma` (inside a graph's warm-up and capture,
below PERSISTENT_ROWS rows: the same kernel on TMA descriptors), `tma ws` (that path with warp specialization, the
tile sweep's candidate), `persistent` (from PERSISTENT_ROWS rows). Compiled as canvas_attention_sm90.py does
(Triton's CUDA backend on the CPU machine, the launch's divisibility-by-16 specialization); the Triton here may not
be the device image's. An older TREE's kernels compile as that tree launched them (its WALK, if any, at 1).
Usage: python3 benchmarks/device/matmul_sm90.py [TREE] [BM,BN,WARPS,STAGES ...] (TREE: a directory holding a fluxlab/,
default this checkout; default tiles: the tables' tiles)
"""
import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from canvas_attention_sm90 import HERE, launch_signature, sm90_usage  # noqa: E402

NOT_SPECIALIZED = {"M", "PROGRAMS"}  # the row count and the persistent grid are whatever the batch makes them


def usage(kernel, constexprs: dict, tile: tuple) -> str:
    block_m, block_n, warps, stages = tile
    def arg_type(name):
        if name.endswith("_desc"):
            return f"tensordesc<bf16[{block_n if name == 'w_desc' else block_m}, {constexprs['BLOCK_K']}]>"
        return "*bf16" if name.endswith("_ptr") else "i32"

    signature, attrs = launch_signature(kernel, constexprs, arg_type,
                                        lambda name: not name.endswith("_desc") and name not in NOT_SPECIALIZED)
    return sm90_usage(kernel, signature, constexprs, attrs, warps, stages)


def main(argv: list[str]) -> None:
    tree = argv[0] if argv and not argv[0][0].isdigit() else HERE
    sys.path.insert(0, tree)
    im = importlib.import_module("fluxlab.kernels.invariant_matmul")
    tiles = [tuple(int(v) for v in arg.split(",")) for arg in argv if arg[0].isdigit()] or list(dict.fromkeys(
        [im.DEFAULT_TILE, *im.SMALL_TILES.values(), *im.LARGE_TILES.values()]))
    print(f"tree {tree}; triton {__import__('triton').__version__}, target sm90")
    names = im._matmul_kernel.arg_names
    for tile in tiles:
        base = dict(BLOCK_M=tile[0], BLOCK_N=tile[1], BLOCK_K=im.BLOCK_K, GROUP_M=im.GROUP_M, W_KN=False)
        own = dict(base, **{name: value for name, value in (("WALK", 1), ("WS", False)) if name in names})
        persistent = dict(base, **({"WALK": 1} if "WALK" in im._persistent_matmul_kernel.arg_names else {}))
        # the launch's unit strides (x and w rows contiguous along K) are specialized as the constant 1
        paths = {"pointers": (im._matmul_kernel, dict(own, IEEE=False, TMA=False, x_desc=None, w_desc=None,
                                                      stride_xk=1, stride_wk=1)),
                 "tma": (im._matmul_kernel, dict(own, IEEE=False, TMA=True)),
                 "persistent": (im._persistent_matmul_kernel, persistent)}
        if "WS" in names:
            paths["tma ws"] = (im._matmul_kernel, dict(own, IEEE=False, TMA=True, WS=True))
        for path, (kernel, constexprs) in paths.items():
            try:
                print(f"{str(tile):18} {path:10} {usage(kernel, constexprs, tile)}")
            except Exception as err:  # ptxas out of registers: a finding, not a stop
                fatal = [line for line in str(err).splitlines() if "fatal" in line] or [type(err).__name__]
                print(f"{str(tile):18} {path:10} does not compile: {fatal[0][:120]}")


if __name__ == "__main__":
    main(sys.argv[1:])
