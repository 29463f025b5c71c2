"""Custom kernels (Triton).

Import from the submodules, e.g. `from fluxlab.kernels.fused_moe import fused_moe, grouped_mm_moe`
(this package re-exports nothing, so `fluxlab.kernels.fused_moe` stays the module and importing the
package does not import triton). `fused_moe.HAVE_TRITON` says whether the Triton path is usable.
"""
