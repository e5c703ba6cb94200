"""The Triton block-bound kernel (`tierkv.sparse.kernels`) against the PyTorch bound of
`BlockSummaries`, through the Triton interpreter on CPU (in a child process, which alone may
import triton in interpreter mode), and compiled on CUDA (`gpu` mark). Fresh random draws each run."""
from __future__ import annotations

import os
import random

import pytest
import torch

from tests.interpreter import run_interpreter_tests
from tierkv.sparse.summaries import BlockSummaries

CHILD = os.environ.get("TIERKV_BOUNDS_CHILD") == "1"


def _cases(device: str, dtypes) -> None:
    """Random tables (Llama-8B and small GQA shapes), slices, limits, bound weights (1: Quest's bound,
    0: the midpoint key's score, a random mix): the kernel's score equals the PyTorch path's, rows past
    the limit are -inf, and top-k picks the same blocks."""
    from tierkv.sparse.kernels import block_bounds

    seed = random.SystemRandom().randrange(2**63)
    gen = torch.Generator().manual_seed(seed)
    for dtype in dtypes:
        for (kv_heads, group, dim, blocks), weight in zip(((8, 4, 128, 300), (2, 3, 40, 37), (1, 1, 16, 5), (3, 3, 64, 50)),
                                                         (1.0, float(torch.rand(1, generator=gen)), 0.0, 0.5)):
            summaries = BlockSummaries(1, kv_heads, dim, dtype, torch.device("cpu"), bound_weight=weight)
            summaries.update(0, 0, torch.randn(blocks, 2, kv_heads, 4, dim, generator=gen))
            table = summaries.tables[0]
            q = torch.randn(kv_heads * group, dim, generator=gen).to(dtype)
            want = summaries.upper_bounds(0, q, torch.arange(blocks))  # the matmul path (a tensor of ids)
            first, stop = sorted(torch.randint(0, blocks + 1, (2,), generator=gen).tolist())
            got = block_bounds(table.to(device), q.to(device), first, stop, bound_weight=weight).cpu()
            torch.testing.assert_close(got, want[first:stop], rtol=1e-4, atol=1e-3, msg=f"seed={seed}")
            limit = int(torch.randint(0, blocks + 1, (1,), generator=gen))
            masked = block_bounds(table.to(device), q.to(device), 0, blocks, torch.tensor(limit).to(device),
                                  bound_weight=weight).cpu()
            assert torch.isinf(masked[limit:]).all() and (masked[limit:] < 0).all(), f"seed={seed}"
            torch.testing.assert_close(masked[:limit], want[:limit], rtol=1e-4, atol=1e-3, msg=f"seed={seed}")
            # written into one row of a batch's scores (the graphed rows' form), its neighbours untouched
            scores = torch.full((3, blocks), 7.0, device=device)
            block_bounds(table.to(device), q.to(device), 0, blocks, torch.tensor(limit).to(device), out=scores[1],
                         bound_weight=weight)
            assert torch.equal(scores[1].cpu(), masked) and (scores[0] == 7).all() and (scores[2] == 7).all()
            with pytest.raises(ValueError, match="out must be"):
                block_bounds(table.to(device), q.to(device), 0, blocks, out=scores[:, 0])
            # several rows, each over a table of its own (sizes differ), in one launch: each row as the
            # one-table kernel masks it at its limit, -inf past it up to the widest table
            from tierkv.sparse.kernels import block_bounds_rows

            others = [BlockSummaries(1, kv_heads, dim, dtype, torch.device("cpu")) for _ in range(2)]
            for n, other in zip((blocks + 3, max(1, blocks // 2)), others):
                other.update(0, 0, torch.randn(n, 2, kv_heads, 4, dim, generator=gen))
            row_tables = [t.to(device) for t in (table, others[0].tables[0], others[1].tables[0])]
            rows_q = torch.randn(3, kv_heads * group, dim, generator=gen).to(dtype).to(device)
            limits = [int(torch.randint(0, t.shape[0] + 1, (1,), generator=gen)) for t in row_tables]
            width = max(t.shape[0] for t in row_tables)
            got_rows = torch.full((3, width), 7.0, device=device)
            addresses = torch.tensor([t.data_ptr() for t in row_tables], dtype=torch.int64, device=device)
            block_bounds_rows(addresses, row_tables[0], rows_q, torch.tensor(limits, device=device), got_rows,
                              bound_weight=weight)
            # another launch shape (blocks per program, warps) gives the same bounds
            other_shape = torch.full((3, width), 7.0, device=device)
            block_bounds_rows(addresses, row_tables[0], rows_q, torch.tensor(limits, device=device), other_shape,
                              block=64, num_warps=2, bound_weight=weight)
            torch.testing.assert_close(other_shape, got_rows, rtol=1e-5, atol=1e-4, msg=f"seed={seed}")
            with pytest.raises(ValueError, match="power of two"):
                block_bounds_rows(addresses, row_tables[0], rows_q, torch.tensor(limits, device=device), other_shape,
                                  block=24)
            for r, t in enumerate(row_tables):
                want_row = block_bounds(t, rows_q[r], 0, t.shape[0], torch.tensor(limits[r]).to(device),
                                        bound_weight=weight).cpu()
                got_row = got_rows[r].cpu()
                # the same sums; compiled, the two kernels may order a row's reduction differently (the rows
                # kernel reads its table through an address of unknown alignment)
                torch.testing.assert_close(got_row[: limits[r]], want_row[: limits[r]], rtol=1e-5, atol=1e-4,
                                           msg=f"seed={seed} row {r}")
                assert torch.isneginf(got_row[limits[r]:]).all(), f"seed={seed} row {r}"
            k = min(4, blocks)
            assert set(torch.topk(got if (first, stop) == (0, blocks) else block_bounds(
                table.to(device), q.to(device), 0, blocks, bound_weight=weight).cpu(), k).indices.tolist()) == set(
                torch.topk(want, k).indices.tolist()), f"seed={seed}"


@pytest.mark.skipif(not CHILD, reason="runs in the child process of test_kernel_in_the_interpreter")
def test_interp_bounds_equal_the_pytorch_bound():
    _cases("cpu", (torch.float32, torch.float16))


def test_kernel_in_the_interpreter():
    pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
    assert "1 passed" in run_interpreter_tests(__file__, "TIERKV_BOUNDS_CHILD", timeout=600)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernel_on_the_gpu_equals_the_pytorch_bound():
    _cases("cuda", (torch.float32, torch.bfloat16))


def test_the_rows_kernel_reads_tables_in_vectors_as_the_one_table_kernel_does():
    """Compiled for the H200 (PTX, no GPU needed): the rows kernel reads each row's table, whose address
    it loads from memory, with the same 128-bit loads as the one-table kernel, whose table is an aligned
    argument. Without its alignment hint it read one bf16 at a time (288 loads, no vector) and took 216 us
    per 10-row launch on the H200, against 125 us for ten one-table launches."""
    pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
    from tests.ptx import global_loads, kernel_ptx
    from tierkv.sparse import kernels as sparse_kernels

    shape = dict(NUM_KV_HEADS=8, G=4, HEAD_DIM=128, D_PAD=128, BLOCK=sparse_kernels.BLOCK_B)  # Llama 8B
    one = global_loads(kernel_ptx(
        sparse_kernels._block_bounds_kernel,
        dict(q_ptr="*bf16", table_ptr="*bf16", out_ptr="*fp32", limit_ptr="*i64", first="i32", num_rows="i32", weight="fp32",
             stride_qh="i32", stride_tb="i32", stride_th="i32"),
        dict(shape, HAS_LIMIT=True), unaligned=("first", "num_rows")))
    rows = global_loads(kernel_ptx(
        sparse_kernels._block_bounds_rows_kernel,
        dict(q_ptr="*bf16", tables_ptr="*i64", like_ptr="*bf16", out_ptr="*fp32", limits_ptr="*i64", width="i32", weight="fp32",
             stride_qr="i32", stride_qh="i32", stride_tb="i32", stride_th="i32", stride_or="i32"),
        shape, unaligned=("width",)))
    assert one["v4"] >= 2 * shape["NUM_KV_HEADS"], one  # key max and key min of every KV head, in vectors
    assert rows["v4"] == one["v4"] and rows["other"] <= one["other"] + 2, (rows, one)
