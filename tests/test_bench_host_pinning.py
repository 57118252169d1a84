"""bench.host_pinning's NUMA report: the pages of a block, read back from /proc/self/numa_maps."""

import os

import pytest
import torch

from bench.host_pinning import numa_pages


@pytest.mark.skipif(not os.path.exists("/proc/self/numa_maps"), reason="needs Linux numa_maps")
def test_numa_pages_counts_the_pages_of_the_mapping_that_holds_a_touched_block():
    block = torch.empty(64 << 20, dtype=torch.uint8)
    block.zero_()  # fault every page in
    nodes = dict(x.split("=") for x in numa_pages(block[32 << 20:].data_ptr()).split())
    assert nodes and all(k[0] == "N" and k[1:].isdigit() for k in nodes)
    assert sum(map(int, nodes.values())) >= (64 << 20) // 4096  # at least every 4 KiB page of the block
    assert numa_pages(0) == "?"  # below every mapping
