"""Where the pages of a host block for GPU copies come from: the GPU's NUMA node, huge pages.

Which NUMA node a GPU hangs off, and asking the kernel to put a host range's pages there:

An offload's host block is read and written by one GPU's copy engines. On a host of several
NUMA nodes, pages on a node far from that GPU cross the socket link on every copy; the kernel
places a page where the thread that first touches it runs, and on whatever node has room once
that one is full. `prefer_node` sets MPOL_PREFERRED on the range before its pages are touched:
the GPU's node while it has room, any other after (never an allocation failure).

`advise_huge_pages` asks for transparent huge pages (madvise MADV_HUGEPAGE) where the
kernel's THP mode is `madvise`: 2 MiB pages mean 512x fewer page-table entries for the DMA
engine to walk and fewer faults when the block is first touched.
"""

from __future__ import annotations

import ctypes
import os
import platform

import torch

MPOL_PREFERRED = 1
MADV_HUGEPAGE = 14
HUGE_PAGE = 2 << 20
_SYS_MBIND = {"x86_64": 237, "aarch64": 235}
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def gpu_node(device: int | torch.device = 0, sysfs: str = "/sys/bus/pci/devices") -> int | None:
    """The NUMA node of CUDA device `device` (sysfs, from its PCI address); None when unknown or
    when the host reports no NUMA (-1)."""
    try:
        props = torch.cuda.get_device_properties(device)
        address = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    except (AssertionError, RuntimeError, AttributeError):  # no CUDA, or a torch without PCI ids
        return None
    return node_of_pci(address, sysfs)


def node_of_pci(address: str, sysfs: str = "/sys/bus/pci/devices") -> int | None:
    """The NUMA node sysfs gives for PCI device `address` ('0000:1b:00.0'); None if -1 or unreadable."""
    try:
        with open(os.path.join(sysfs, address.lower(), "numa_node")) as f:
            node = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def prefer_node(tensor: torch.Tensor, node: int) -> bool:
    """Ask that the not-yet-touched pages of CPU `tensor` come from NUMA node `node` (mbind
    MPOL_PREFERRED over the whole pages it spans). False where the kernel or the architecture
    does not allow it; the pages then go where they would have anyway."""
    number = _SYS_MBIND.get(platform.machine())
    if number is None or not 0 <= node < 128 or tensor.device.type != "cpu" or not tensor.nbytes:
        return False
    start = -(-tensor.data_ptr() // _PAGE) * _PAGE  # whole pages only: the policy is per page
    end = (tensor.data_ptr() + tensor.nbytes) // _PAGE * _PAGE
    if end <= start:
        return False
    mask = (ctypes.c_ulong * 2)()
    mask[node // 64] = 1 << (node % 64)
    libc = ctypes.CDLL(None, use_errno=True)
    result = libc.syscall(ctypes.c_long(number), ctypes.c_void_p(start), ctypes.c_ulong(end - start),
                          ctypes.c_int(MPOL_PREFERRED), mask, ctypes.c_ulong(129), ctypes.c_uint(0))
    return result == 0


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """madvise(MADV_HUGEPAGE) over the whole 2 MiB pages CPU `tensor` spans, before they are
    touched. It takes effect where the kernel's THP mode is `madvise` (with `always` the pages
    are huge anyway, with `never` not at all); False where the kernel refuses the call or the
    range holds no whole huge page."""
    if tensor.device.type != "cpu":
        return False
    start = -(-tensor.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (tensor.data_ptr() + tensor.nbytes) // HUGE_PAGE * HUGE_PAGE
    if end <= start:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(start, end - start, MADV_HUGEPAGE) == 0
