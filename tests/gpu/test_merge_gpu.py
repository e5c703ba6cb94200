"""GPU: `merge_two_into`'s cupy kernel (the one a sparse decode step launches per layer under vLLM)
against the PyTorch reference and the Triton kernel, for the vLLM backend's operands (a bfloat16
output, a bfloat16 near part with its LSE transposed as FlashAttention returns it, a float32 far
part), all-float32 operands, rows where one part saw no key and a row where neither did; and the
host time per launch of both kernels, printed (measured, not asserted: the machine is shared)."""
from __future__ import annotations

import random
import time

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (run on the GPU machine)", allow_module_level=True)

pytest.importorskip("cupy", reason="the merge kernel is launched through cupy (extra 'gpu')")

from tierkv.attention import cupy_merge, merge_two_into, reference, triton_installed  # noqa: E402


def parts(gen, n: int, heads: int, dim: int, out_dtype, near_dtype):
    near = (torch.randn(n, heads, dim, generator=gen).to(near_dtype).cuda(),
            (4 * torch.randn(heads, n, generator=gen)).cuda().t())  # FlashAttention's [H, n], transposed
    far = (torch.randn(n, heads, dim, generator=gen).cuda(), (4 * torch.randn(n, heads, generator=gen)).cuda())
    near[1][0, 1] = float("-inf")   # the near part saw no key for this head
    near[0][0, 1] = 0
    far[1][n - 1, 2] = float("-inf")  # nor the far part here
    far[0][n - 1, 2] = 0
    near[1][n // 2, 3] = far[1][n // 2, 3] = float("-inf")  # neither: out 0
    near[0][n // 2, 3] = 0
    far[0][n // 2, 3] = 0
    return torch.full((n, heads, dim), float("nan"), dtype=out_dtype, device="cuda"), near, far


@pytest.mark.parametrize("out_dtype,near_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                                  (torch.bfloat16, torch.float32)])
def test_cupy_merge_equals_the_reference(out_dtype, near_dtype):
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    for n in (1, 7, 64):
        got, near, far = parts(gen, n, 32, 128, out_dtype, near_dtype)
        assert cupy_merge.supports(got, near, far)
        merge_two_into(got, near, far)
        want = torch.empty(n, 32, 128, dtype=torch.float32, device="cuda")
        reference.merge_two_into(want, (near[0].float(), near[1]), far)
        assert not got.isnan().any(), f"seed={seed} n={n}"
        assert torch.equal(got[n // 2, 3], torch.zeros_like(got[n // 2, 3])), f"seed={seed} n={n}: no key anywhere"
        tol = 1e-6 if out_dtype == torch.float32 else 8e-3  # bfloat16: one rounding of the result
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol, msg=f"seed={seed} n={n}")
        # rounding to bfloat16 is to nearest even: the result equals PyTorch's cast of the float32 merge
        if out_dtype == torch.bfloat16:
            exact = torch.empty_like(want)
            cupy_merge.merge_two_into(exact, near, far)
            assert torch.equal(got, exact.to(torch.bfloat16)), f"seed={seed} n={n}"


def test_cupy_merge_host_time_against_triton():
    gen = torch.Generator().manual_seed(0)
    out, near, far = parts(gen, 1, 32, 128, torch.bfloat16, torch.bfloat16)
    timings = {}
    launchers = {"cupy": merge_two_into}
    if triton_installed():
        from tierkv.attention import triton_paged
        launchers["triton"] = triton_paged.merge_two_into
    for name, launch in launchers.items():
        for _ in range(20):
            launch(out, near, far)
        torch.cuda.synchronize()
        times = []
        for _ in range(200):
            started = time.perf_counter()
            launch(out, near, far)
            times.append(time.perf_counter() - started)
        torch.cuda.synchronize()
        timings[name] = sorted(times)[len(times) // 2] * 1e6
    print("merge_two_into host us per launch (median of 200):",
          ", ".join(f"{name} {us:.1f}" for name, us in timings.items()))
    if "triton" in timings:  # both give the same result
        want = torch.empty_like(out)
        from tierkv.attention import triton_paged
        triton_paged.merge_two_into(want, near, far)
        got = torch.empty_like(out)
        merge_two_into(got, near, far)
        torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=8e-3)
