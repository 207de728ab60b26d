"""Compile the fused Triton kernels for a GPU (sm_90) on a machine without one.

    python tests/torch/triton_gpu_compile.py

Triton's interpreter runs the kernels' Python on CPU tensors, so it never
meets Triton's code generator; this builds each kernel (every state storage)
to PTX and cubin as a GPU launch would, and prints each one's number of fused
multiply-adds (the kernels are compiled without FMA contraction, so 0). Run
by ``test_torch_triton.py`` in a process without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from qhoptim.torch import _triton

assert os.environ.get("TRITON_INTERPRET") != "1", "the compiler, not the interpreter"

POINTERS = {
    "addrs": "*i64", "numels": "*i64", "block_tensor": "*i32", "block_start": "*i64",
    "table": "*fp64", "seeds": "*i64", "scale_ptr": "*fp32", "inf_ptr": "*fp32",
    "levels_signed": "*fp32", "levels_unsigned": "*fp32",
}  # fmt: skip
INTEGERS = {"n_tensors": "i32", "row_stride": "i32"}


def compile_kernel(kernel: object, constexprs: dict[str, object]) -> str:
    names = kernel.arg_names  # type: ignore[attr-defined]
    signature = {
        name: "constexpr" if name in constexprs else POINTERS.get(name, INTEGERS.get(name, "fp32"))
        for name in names
    }
    source = ASTSource(
        fn=kernel,
        signature=signature,
        constexprs={(names.index(k),): v for k, v in constexprs.items()},
    )
    options = {"enable_fp_fusion": False, "num_warps": 4}
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    return str(compiled.asm["ptx"])


def main() -> None:
    common = {"IN_TABLE": False, "HAS_SCALE": True, "HAS_INF": True, "DTYPE": tl.float32,
              "COMPUTE": tl.float32, "BLOCK": _triton._BLOCK}  # fmt: skip
    kernels = {
        "qhm": (_triton._qhm_kernel, {}),
        "qhadam": (_triton._qhadam_kernel, {"FORM": 2, "AMSGRAD": True}),
    }
    for name, (kernel, extra) in kernels.items():
        for narrow in (_triton._SAME, _triton._BFLOAT16, _triton._EIGHT_BIT):
            ptx = compile_kernel(kernel, {**common, **extra, "NARROW": narrow})
            print(f"{name} NARROW={narrow} fma={ptx.count('fma.rn.f32')}")


if __name__ == "__main__":
    main()
