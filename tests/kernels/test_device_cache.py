"""The per-layout tables a store prepares are the ones the launchers look up (same cache keys), for every format.

CUDA-graph safety itself (no table allocated inside a graph's memory pool) is checked on the GPU by
benchmarks/reliability_gpu.py (reduce-overhead section); here: the preparation builds exactly the cache entries the
kernels' launchers and the references use, so a later launch finds them and allocates nothing.
"""

from __future__ import annotations

import pytest
import torch

from ckvp_compile.kernels import device_cache
from ckvp_compile.kernels import latent_attention_triton as lat
from ckvp_compile.kernels import latent_quant_triton as lq
from ckvp_compile.kernels import reference as ref
from ckvp_compile.kernels.latent_format import _e4m3_grid, _layout_index, parse_latent_format, quantize_latent_ref


@pytest.mark.parametrize("fmt", ["float", "int8", "int4/32", "int2", "tern", "tern/64", "mxint8", "mxint4/32",
                                 "mix/8:8x5+2x8,4x7", "int4/32-f8", "mix/8-f8:8x5+2x8,4x7"])
def test_prepare_builds_the_launchers_cache_entries(fmt):
    off = [0, 13, 20]
    cpu = torch.device("cpu")
    for cache in (ref._head_columns_cached, _layout_index, lq._tables, lq._head_tables, _e4m3_grid):
        cache.cache_clear()
    lat._META.clear()
    device_cache._prepare(off, fmt, 16, cpu)
    f = parse_latent_format(fmt)
    hits = (ref._head_columns_cached.cache_info().currsize, _layout_index.cache_info().currsize,
            lq._tables.cache_info().currsize, len(lat._META))
    assert hits == (1, 2 if f.quantized else 0, 1 if lq.unsupported_reason(f, torch.device("cuda")) is None else 0, 1)
    # the launchers' own calls now hit those entries (no new table)
    ref._head_columns(off, 16, cpu)
    lat._head_meta(off, fmt, cpu)
    fused = lq.format_family(f) in ("int", "mix")  # latent_append_triton's table too
    assert lq._head_tables.cache_info().currsize == int(fused)
    if hits[2]:
        lq._tables(tuple(off), f.name, str(cpu))
    if fused:
        lq._head_tables(tuple(off), f.name, str(cpu))
    assert (ref._head_columns_cached.cache_info().currsize, lq._tables.cache_info().currsize, len(lat._META),
            lq._head_tables.cache_info().currsize) == (hits[0], hits[2], hits[3], int(fused))
    if f.meta_f8:  # the reference quantizer's e4m3 rounding table: built, and found by a quantization
        assert _e4m3_grid.cache_info().currsize >= 1
        before = _e4m3_grid.cache_info().hits
        quantize_latent_ref(torch.randn(2, off[-1]), off, fmt)
        assert _e4m3_grid.cache_info().hits > before


def test_prepare_does_nothing_off_cuda():
    lat._META.clear()
    device_cache.prepare_device_tables([0, 4], "int8", 4, "cpu")
    assert not lat._META
