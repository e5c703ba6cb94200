"""Compile a `@triton.jit` kernel for the H200 (sm_90) on a machine without a GPU and read its PTX:
what a kernel's loads compile to (one element at a time, or 128-bit vectors) is then testable on CPU.
Needs triton's NVIDIA backend (its pip wheel carries it); no CUDA device or driver."""
from __future__ import annotations

import re


def kernel_ptx(fn, types: dict[str, str], constexprs: dict[str, object], unaligned: tuple[str, ...] = ()) -> str:
    """fn: the jitted kernel; types: Triton type per runtime argument ("*bf16", "i32", ...); constexprs:
    their values. Every argument but those in `unaligned` compiles as Triton specializes an argument
    divisible by 16 (aligned pointers, strides), as a launch with such arguments does."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    missing = [n for n in names if n not in types and n not in constexprs]
    if missing:
        raise ValueError(f"kernel_ptx: no type or constexpr for {missing}")
    signature = {n: "constexpr" if n in constexprs else types[n] for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in types and n not in unaligned}
    source = ASTSource(fn=fn, signature=signature, attrs=attrs,
                       constexprs={(names.index(n),): v for n, v in constexprs.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]


def global_loads(ptx: str) -> dict[str, int]:
    """Global loads of a PTX text by width: 'v4' (four 32-bit words: 128 bits) and 'other'."""
    loads = re.findall(r"ld\.global(?:\.[a-z0-9]+)*", ptx)
    v4 = sum(1 for op in loads if ".v4" in op)
    return {"v4": v4, "other": len(loads) - v4}
