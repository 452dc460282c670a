"""`HostLayout`: the host row's arithmetic, direct and canonical, and what a region must hold."""

from __future__ import annotations

import pytest
import torch
from helpers import small_kv

from offload_core import InvalidSpecError, KVCacheRef, KVCaches, KVCacheTensor, SharedHostRegion
from offload_core.canonical import attention_mappings
from offload_core.compact import CompactLayout
from offload_core.host_layout import HostLayout


def test_direct_rows_hold_every_tensors_chunk_back_to_back():
    layout = HostLayout.of(small_kv(pages=(64, 128, 32)), blocks_per_chunk=2)
    assert layout.pages == (64, 128, 32) and layout.offsets == (0, 128, 384) and layout.row_bytes == 448
    rows = torch.arange(3 * 448, dtype=torch.int32).to(torch.int8).view(3, 448)
    views = layout.views(rows)
    assert [tuple(v.shape) for v in views] == [(3, 128), (3, 256), (3, 64)]
    assert views[1].data_ptr() == rows.data_ptr() + 128 and views[1].stride(0) == 448


def test_canonical_pages_are_the_unsharded_ones_whatever_the_padding():
    """TP=2 of 4 heads: this rank's page is half the canonical one; a padded pitch changes nothing."""
    m = attention_mappings(total_kv_heads=4, tp_size=2, block_tokens=2, head_bytes=16)
    local = m[0].local_page_size_bytes
    backing = torch.zeros(8, 2 * local + 16, dtype=torch.int8)
    tensors = [KVCacheTensor(backing[:, :local], local), KVCacheTensor(torch.zeros(8, 48, dtype=torch.int8), 48)]
    kv = KVCaches(tensors, [[KVCacheRef(0, local, m[0])], [KVCacheRef(1, 40)]])
    layout = HostLayout.of(kv, canonical=True)
    assert layout.pages == (m[0].canonical_page_size_bytes, 40) and layout.canonical
    assert HostLayout.of(kv).pages == (local, 48)
    # the worker's table of copies: device rows a pitch apart, host pages the layout's; the mapping
    # scatters the page in the canonical layout, the direct one copies it whole
    entries = CompactLayout(kv, layout, 1 << 30, 4096, 4, compiled=False).entries
    fragments = m[0].fragments[2].size
    assert entries[1].tolist() == [2 * local + 16] * fragments + [48]
    assert entries[4].tolist() == [layout.pages[0]] * fragments + [40]
    assert entries[5].tolist() == m[0].fragments[2].tolist() + [40]
    assert CompactLayout(kv, HostLayout.of(kv), 0, 4096, 4, compiled=False).entries[5].tolist() == [local, 40]


def test_a_region_must_match_the_layout(tmp_path):
    layout = HostLayout.of(small_kv(pages=(64, 128)))
    with SharedHostRegion("r", num_blocks=4, slot_bytes=[192], directory=tmp_path) as region:
        layout.check_region(region, 4)
        with pytest.raises(InvalidSpecError, match="has 4 host blocks"):
            layout.check_region(region, 5)
        with pytest.raises(InvalidSpecError, match="canonical"):
            HostLayout.of(small_kv(pages=(64, 128)), canonical=True).check_region(region, 4)
    with SharedHostRegion("s", num_blocks=4, slot_bytes=[100], directory=tmp_path) as region:
        with pytest.raises(InvalidSpecError, match="needs 192 bytes per host block, its slot has 100"):
            layout.check_region(region, 4)
