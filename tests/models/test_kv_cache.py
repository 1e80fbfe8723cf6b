import pytest
import torch

from specdecode.models.kv_cache import BLOCK, KVCache


def make_cache(length: int) -> KVCache:
    cache = KVCache(num_layers=2, batch_size=1, num_kv_heads=1, max_len=32, head_dim=2, dtype=torch.float32)
    values = torch.arange(length, dtype=torch.float32).view(1, 1, length, 1).expand(1, 1, length, 2)
    for layer in range(2):
        cache.write(layer, values, -values)
    cache.advance(length)
    return cache


def test_buffer_is_whole_attention_blocks():
    assert make_cache(3).max_len == BLOCK


def test_rewind_is_an_integer_move():
    cache = make_cache(10)
    cache.rewind(4)
    assert cache.length == 6
    with pytest.raises(ValueError):
        cache.rewind(7)


def test_compact_gathers_a_path_into_contiguous_slots():
    cache = make_cache(10)
    cache.compact([5, 6, 8, 9])
    assert cache.length == 9  # slots before the first index stay; 4 kept from slot 5 on
    kept = cache.keys[1, 0, 0, :9, 0].tolist()
    assert kept == [0, 1, 2, 3, 4, 5, 6, 8, 9]
    assert cache.values[0, 0, 0, :9, 1].tolist() == [-x for x in kept]


@pytest.mark.parametrize("bad", [[3, 2], [4, 10], []])
def test_compact_refuses_bad_indices(bad):
    with pytest.raises(ValueError):
        make_cache(10).compact(bad)


def test_full_cache_is_refused():
    cache = make_cache(BLOCK - 2)
    with pytest.raises(ValueError, match="full"):
        cache.check_room(3)
