"""The canvas attention kernel's sm90 resources without a GPU: registers, stack (spills) and shared memory per tile.

Triton compiles for an sm90 target on any machine that has its CUDA backend (ptxas ships in the wheel), so register
pressure can be read on the CPU machine before a device call. Integer arguments and pointers get the divisibility-
by-16 specialization the launch gives them at the 26B-A4B shapes (strides, head dim, canvas length, window are
multiples of 16; the kernel's `do_not_specialize` arguments and `group` are not): without it the gathers compile
unvectorized and every tile seems to spill kilobytes. The Triton here may not be the device image's (3.6): the
numbers are a guide, ncu on the device is the measure (docs/benchmarks.md).
Usage: python3 benchmarks/device/canvas_attention_sm90.py [TREE] [BM,BN,WARPS,STAGES,DP,SLIDING ...]
(TREE: a directory holding a fluxlab/ to compile, default this checkout; no tiles: the shipped tiles and the
probe's candidates at the 26B head dims, sliding with and without this forward's keys)
"""
import contextlib
import importlib
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOT_SPECIALIZED = {"num_slots", "stride_query", "stride_slots", "stride_fresh", "stride_geom", "group"}
INDEX_POINTERS = {"query_ptr", "canvas_ptr", "slots_ptr", "fresh_ptr", "geom_ptr"}
DEFAULT_TILES = [(64, 64, 8, 2, 256, True), (128, 64, 8, 1, 256, True), (128, 64, 8, 2, 256, True),
                 (64, 32, 8, 2, 512, False), (64, 32, 8, 3, 512, False)]


def resources(kernel, tile: tuple, fresh: bool) -> str:
    block_m, block_n, warps, stages, padded, sliding = tile
    constexprs = dict(BLOCK_M=block_m, BLOCK_N=block_n, DP=padded, SLIDING=sliding, HAS_FRESH=fresh, IEEE=False)
    if "EVEN_D" in kernel.arg_names:  # the 26B head dims are powers of two: the launch's EVEN_D
        constexprs["EVEN_D"] = True
    signature, attrs = launch_signature(
        kernel, constexprs,
        lambda name: ("*i64" if name in INDEX_POINTERS else "*bf16") if name.endswith("_ptr") else
        "fp32" if name == "scale_log2" else "i32",
        lambda name: name.endswith("_ptr") or (name != "scale_log2" and name not in NOT_SPECIALIZED))
    return sm90_usage(kernel, signature, constexprs, attrs, warps, stages)


def launch_signature(kernel, constexprs: dict, arg_type, specialized) -> tuple[dict, dict]:
    """(signature, attrs) of `kernel` as a launch compiles it: the constexprs as such, every other argument typed
    `arg_type(name)` (None: left out) and, where `specialized(name)`, marked divisible by 16, the specialization a
    launch gives aligned pointers, strides and sizes (without it loads compile unvectorized and seem to spill)."""
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        kind = "constexpr" if name in constexprs else arg_type(name)
        if kind is None:
            continue
        signature[name] = kind
        if kind != "constexpr" and specialized(name):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, attrs


def sm90_usage(kernel, signature: dict, constexprs: dict, attrs: dict, warps: int, stages: int) -> str:
    """'REG:n STACK:n shared n SASS n' of `kernel` compiled for sm90 (a ptxas failure raises). Env PDL=1: with
    programmatic dependent launch (kernels/pdl.py), as FLUXLAB_PDL=1 launches it."""
    compiled, usage, sass = compile_sm90(kernel, signature, constexprs, attrs, warps, stages)
    line = next(line for line in usage.splitlines() if "REG:" in line).split()
    instructions = sum(1 for row in sass.splitlines() if row.strip().startswith("/*") and "*/" in row.strip()[2:8])
    return f"{line[0]:8} {line[1]:11} shared {compiled.metadata.shared:<6} SASS {instructions}"


def compile_sm90(kernel, signature: dict, constexprs: dict, attrs: dict, warps: int, stages: int):
    """`kernel` compiled for sm90 -> (the compiled kernel, cuobjdump's resource usage, its SASS listing). Env PDL=1 as
    in `sm90_usage`."""
    import triton
    from triton.backends.compiler import GPUTarget

    if "PDL" in kernel.arg_names:
        constexprs = dict(constexprs, PDL=os.environ.get("PDL") == "1")
        signature = dict(signature, PDL="constexpr")

    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    # a ptxas failure prints the whole PTX: keep the exception's message, not the listing
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 128),
                                  options=dict(num_warps=warps, num_stages=stages,
                                               launch_pdl=os.environ.get("PDL") == "1"))
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", cubin.name], capture_output=True, text=True).stdout
        sass = subprocess.run([cuobjdump, "-sass", cubin.name], capture_output=True, text=True).stdout
    return compiled, usage, sass


def main(argv: list[str]) -> None:
    tree = argv[0] if argv and not argv[0][0].isdigit() else HERE
    tiles = [tuple(int(v) for v in arg.split(",")) for arg in argv if arg[0].isdigit()] or DEFAULT_TILES
    sys.path.insert(0, tree)
    kernel = importlib.import_module("fluxlab.kernels.canvas_attention")._canvas_attention_kernel
    print(f"tree {tree}; triton {__import__('triton').__version__}, target sm90")
    for tile in tiles:
        tile = tile[:5] + (bool(tile[5]),)
        for fresh in ([True, False] if tile[5] else [False]):
            try:
                print(tile, "fresh" if fresh else "     ", resources(kernel, tile, fresh))
            except Exception as err:  # ptxas out of registers, shared memory over the limit: a finding, not a stop
                fatal = [line for line in str(err).splitlines() if "fatal" in line] or [type(err).__name__]
                print(tile, "fresh" if fresh else "     ", f"does not compile: {fatal[0][:120]}")


if __name__ == "__main__":
    main(sys.argv[1:])
