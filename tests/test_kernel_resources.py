"""experiments/kernel_resources.py: the kernels' shared memory for sm_90, compiled on this host.

Needs the `triton` package (not a dependency of the library); skipped where it is missing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    sys.path.insert(0, str(ROOT / "experiments"))
    import kernel_resources

    return kernel_resources


def test_parse_fields():
    sys.path.insert(0, str(ROOT / "experiments"))
    import bench_attention as tool  # the --sizes parser kernel_resources.py shares

    assert tool.parse_fields("block_h=32,num_stages=None") == {"block_h": 32, "num_stages": None}
    with pytest.raises(SystemExit, match="FIELD=VALUE"):
        tool.parse_fields("block_h")


def _shared_bytes(tool, workload, kernel):
    fn, fn_args, _ = workload
    launches = {name: rest for name, *rest in tool.lowered_kernels(fn, *fn_args)}
    return tool.compile_for_hopper(*launches[kernel])["shared"]


def test_papers_shapes_against_the_shared_memory_limit():
    """DeepSeek-V3.2's 64 indexer heads fit a program (query tiles read at every key block; the
    H100 reported 360,448 bytes when they were held), and so does a 64-head key-gradient program
    of MLA's attention (key-major with column chunks; head-major, the H100 reported 272-308
    KiB), but not at 256-wide chunks."""
    pytest.importorskip("triton")
    tool = _tool()
    common = dict(seq=1024, topk=2048, index_dim=128)
    hytopk = tool.hytopk_workload(argparse.Namespace(sizes="", **common), 64)
    assert _shared_bytes(tool, hytopk, "hytopk_fused_select") <= tool.SHARED_LIMIT
    for sizes, fits in (("block_h_dkv=64", True), ("block_h_dkv=64,dkv_chunk=256", False)):
        mla = argparse.Namespace(sizes=sizes, dim=576, value_dim=512, deterministic=None, **common)
        dkv = _shared_bytes(tool, tool.attention_workload(mla, 64), "sparse_attn_bwd_dkv")
        assert (dkv <= tool.SHARED_LIMIT) == fits, (sizes, dkv)


def test_indexer_loss_backward_given_the_target_reads_no_main_keys():
    """At GLM-5.1's shape (64 heads of 576, indexer 32 x 128, the attention's log-sum-exps
    given) the backward that reads the saved target gathers only the indexer's keys: a
    fraction of the recomputing backward's shared memory, at five pipelining stages."""
    pytest.importorskip("triton")
    tool = _tool()
    shared = {}
    for save_target, kernel in (
        (False, "indexer_kl_bwd_atomic"),
        (True, "indexer_kl_bwd_given_target_atomic"),
    ):
        args = argparse.Namespace(
            sizes="",
            seq=1024,
            topk=2048,
            dim=576,
            index_dim=128,
            given_lse=True,
            save_target=save_target,
        )
        fn, fn_args, _ = tool.indexer_loss_workload(args, 64, 32)
        launches = {name: rest for name, *rest in tool.lowered_kernels(fn, *fn_args)}
        ir, warps, stages = launches[kernel]
        assert stages == 5, (kernel, warps, stages)
        shared[save_target] = tool.compile_for_hopper(ir, warps, stages)["shared"]
    assert shared[True] * 4 < shared[False] <= tool.SHARED_LIMIT, shared
