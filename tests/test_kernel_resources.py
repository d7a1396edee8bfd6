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
