"""Weights and caches on 2 MB pages: fewer TLB misses while a decoding step streams them.

A step reads about 3 GB of weights front to back. On 4 KB pages that is some 750,000
page-table walks per step; on 2 MB pages, 1,500. Linux gives anonymous memory huge
pages where a program asks for them (transparent huge pages in `madvise` mode, the
default on many distributions), so the packed weights are copied into a mapping that
asks. Where the kernel says no, the copy is ordinary memory and nothing else changes.

Matrices under 2 MB (a 1.5B model's attention projections, every matrix of a small draft)
share regions of REGION bytes rather than each sitting on 4 KB pages of the heap: a step
reads them once each, cold, and on 4 KB pages the CPU's prefetchers stop at every page
while each page costs a table walk. Qwen2.5-1.5B Q4_K_M, one-token steps after 256 tokens,
Intel Xeon with AMX, 2 threads, two runs each: the q|k|v products took 10.2-12.3 ms of a
step on 4 KB pages and 5.0-6.1 in shared regions, the o products 6.2-10.1 and 3.1-3.2, the
whole step 79-85 and 67-76. That was with the machine's caches under load from elsewhere
(steps of 67-85 ms); in a quieter hour (steps of 47-60 ms) the two were alike, as earlier
tries on quiet machines had found (AMD EPYC Zen 3 and Intel Xeon). The key/value cache
goes on huge pages too (zeros_on_huge_pages): attention reads each layer's keys cold.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import threading

import torch

HUGE = 2 * 2**20  # bytes in a huge page
REGION = 32 * 2**20  # a shared region for tensors under HUGE bytes
ALIGN = 64  # bytes: a cache line, as the kernels' vector loads like it


def _advised_region(nbytes: int) -> tuple[mmap.mmap, int]:
    """A private anonymous mapping of at least nbytes advised for huge pages, and the offset
    of its first 2 MB boundary (from which nbytes are free)."""
    # private and anonymous (a shared mapping would be shmem, whose huge pages are off by default);
    # one spare huge page to align within
    region = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    offset = -address % HUGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, offset, nbytes + HUGE - offset)
    except OSError:  # no transparent huge pages here: ordinary pages
        pass
    return region, offset


class _SharedRegion:
    """Where the next small tensor goes: a region and the bytes of it handed out. Each tensor
    keeps its region's mapping alive (torch.frombuffer holds the buffer), so a region is
    unmapped once every tensor in it is gone and the module has moved on to a new one."""

    def __init__(self):
        self.lock = threading.Lock()
        self.region: mmap.mmap | None = None
        self.used = self.end = 0

    def take(self, nbytes: int) -> tuple[mmap.mmap, int]:
        with self.lock:
            start = -(-self.used // ALIGN) * ALIGN
            if self.region is None or start + nbytes > self.end:
                self.region, start = _advised_region(REGION)
                self.end = start + REGION
            self.used = start + nbytes
            return self.region, start


_shared = _SharedRegion()


def _usable() -> bool:
    return hasattr(mmap, "MADV_HUGEPAGE")


def on_huge_pages(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a CPU tensor, in memory advised for transparent huge pages: a
    mapping of its own from 2 MB on, a shared region below. Always a copy: nothing keeps
    the memory map a tensor came from (prepared.py) open."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0 or tensor.device.type != "cpu" or not _usable():
        return tensor.clone(memory_format=torch.contiguous_format)
    region, offset = _advised_region(nbytes) if nbytes >= HUGE else _shared.take(nbytes)
    out = torch.frombuffer(region, dtype=tensor.dtype, count=tensor.numel(), offset=offset).view(tensor.shape)
    out.copy_(tensor)
    return out


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros in a mapping of its own advised for huge pages (from 2 MB on;
    smaller ones are ordinary torch.zeros). A fresh anonymous mapping reads as zeros, and
    its pages are only taken as they are first written."""
    count = math.prod(shape)
    nbytes = count * torch.empty(0, dtype=dtype).element_size()
    if nbytes < HUGE or not _usable():
        return torch.zeros(shape, dtype=dtype)
    region, offset = _advised_region(nbytes)
    return torch.frombuffer(region, dtype=dtype, count=count, offset=offset).view(shape)
