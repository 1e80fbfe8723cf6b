from pathlib import Path

import pytest
import torch

from specdecode.models.linear import Linear


@pytest.mark.parametrize("shape", [(1536, 8960), (17920, 1536), (2048, 1536)])
def test_packed_bf16_rows_do_not_depend_on_the_row_count(shape):
    """Verification of up to 10 drafts (11 rows) must round exactly as one-row decoding."""
    generator = torch.Generator().manual_seed(0)
    linear = Linear(torch.randn(*shape, generator=generator).to(torch.bfloat16))
    x = torch.randn(11, shape[1], generator=generator).to(torch.bfloat16)
    one_by_one = torch.cat([linear(x[i:i + 1]) for i in range(11)])
    for rows in range(2, 12):
        assert torch.equal(linear(x[:rows]), one_by_one[:rows]), rows


def test_fp32_is_not_packed_and_matches_f_linear():
    weight, bias = torch.randn(8, 4), torch.randn(8)
    linear = Linear(weight, bias)
    assert not linear.packed
    torch.testing.assert_close(linear(torch.ones(2, 4)), torch.ones(2, 4) @ weight.T + bias)


def _anon_huge_kb(address: int) -> int:
    """AnonHugePages of the mapping holding address, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


def test_packed_weights_live_on_huge_pages_where_the_kernel_allows():
    from specdecode.models.huge_pages import HUGE, on_huge_pages

    small = torch.arange(6.0).view(2, 3)
    assert on_huge_pages(small).data_ptr() != 0 and torch.equal(on_huge_pages(small), small)
    big = torch.randn(64, 4, 2**14).permute(1, 0, 2)  # 16 MB, not contiguous
    moved = on_huge_pages(big)
    assert torch.equal(moved, big) and moved.is_contiguous() and moved.data_ptr() % HUGE == 0
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if mode.exists() and ("[madvise]" in mode.read_text() or "[always]" in mode.read_text()):
        assert _anon_huge_kb(moved.data_ptr()) >= 8 * 1024  # most of its 16 MB on 2 MB pages


def test_small_weights_share_huge_page_regions_and_caches_start_as_zeros():
    from specdecode.models.huge_pages import ALIGN, HUGE, on_huge_pages, zeros_on_huge_pages

    parts = [torch.randn(300, 1000 + i) for i in range(6)]  # 1.2 MB each: under a huge page
    moved = [on_huge_pages(p) for p in parts]
    assert all(torch.equal(m, p) and m.is_contiguous() and m.data_ptr() % ALIGN == 0 for m, p in zip(moved, parts))
    starts = sorted(m.data_ptr() for m in moved)
    assert sum(b - a < HUGE for a, b in zip(starts, starts[1:])) >= 4  # neighbours, not a mapping each
    cache = zeros_on_huge_pages((2, 3, 2048, 128), torch.bfloat16)  # 3 MB
    assert cache.shape == (2, 3, 2048, 128) and cache.dtype == torch.bfloat16 and not cache.any()
    cache[1, 2, 7] = 1.5
    assert cache.sum().item() == 1.5 * 128
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if mode.exists() and ("[madvise]" in mode.read_text() or "[always]" in mode.read_text()):
        cache.fill_(1)
        assert _anon_huge_kb(cache.data_ptr()) >= 2 * 1024
        assert _anon_huge_kb(moved[0].data_ptr()) >= 2 * 1024
