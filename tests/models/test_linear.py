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
