"""The paged block attention kernel's sm90 resources without a GPU (kernels/block_attention.py, attention=triton):
registers, stack (spills), shared memory and SASS size of LLaDA2's decode program (4 query heads packed on a KV head,
blocks of 32, head_dim 128, bf16 pages) at 4 and 8 warps and 1 and 2 pages a softmax step, and, where the tree's kernel
has it, with the output quantized for an FP8 projection (QUANT). Compiled as canvas_attention_sm90.py compiles
(pointers and strides with the launch's divisibility-by-16 specialization); the device image's Triton is 3.6
(pip download triton==3.6.0, --target DIR, PYTHONPATH=DIR). A guide to pick candidates, not a measurement.
Usage: python3 benchmarks/device/block_attention_sm90.py [TREE]   (TREE: a directory holding a fluxlab/)
"""
import importlib
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from canvas_attention_sm90 import HERE, launch_signature, sm90_usage  # noqa: E402

NOT_SPECIALIZED = {"group"}  # query heads a KV head: 4 in LLaDA2, never a multiple of 16
FLOATS = {"scale_log2", "k_scale", "v_scale"}


def usage(kernel, warps: int, pages: int, quant: bool) -> str:
    constexprs = dict(BL=32, BM=32, PACK=4, D=128, PAGES=pages, IEEE=False, KV_FP8=False)
    if "QUANT" in kernel.arg_names:
        constexprs.update(QUANT=quant, INTERPRET=False)
    def arg_type(name):
        if name.endswith("_ptr"):
            return {"table_ptr": "*i32", "used_ptr": "*i32", "s_ptr": "*fp32"}.get(
                name, "*fp8e4nv" if name == "out_ptr" and quant else "*bf16")
        return "fp32" if name in FLOATS else None if name == "PDL" else "i32"

    signature, attrs = launch_signature(kernel, constexprs, arg_type,
                                        lambda name: name not in FLOATS and name not in NOT_SPECIALIZED)
    return sm90_usage(kernel, signature, constexprs, attrs, warps, 2)


def main(argv: list[str]) -> None:
    tree = argv[0] if argv else HERE
    sys.path.insert(0, tree)
    kernel = importlib.import_module("fluxlab.kernels.block_attention")._block_attention_kernel
    print(f"tree {tree}; triton {__import__('triton').__version__}, target sm90; LLaDA2 decode program "
          "(PACK 4 x BM 32 rows, D 128), 2 stages")
    quants = (False, True) if "QUANT" in kernel.arg_names else (False,)
    for quant, warps, pages in itertools.product(quants, (4, 8), (1, 2)):
        try:
            line = usage(kernel, warps, pages, quant)
        except Exception as err:  # a ptxas failure: its first line
            line = "FAILED " + str(err).splitlines()[0][:160]
        print(f"  quantize {str(quant):5} warps {warps} pages {pages}: {line}")


if __name__ == "__main__":
    main(sys.argv[1:])
