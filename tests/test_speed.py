"""`specdecode speed`: the decoding rate is timed apart from the prompt's prefill, and the
figures it reports agree with each other."""

from __future__ import annotations

import pytest

from specdecode.errors import SpecDecodeError
from specdecode.commands.speed import Timing, format_speed, run_speed


def test_timing_splits_the_first_token_from_the_decoding_rate():
    t = Timing(prefill_s=1.0, decode_s=2.0, new_tokens=5)
    assert t.tokens_per_s == 2.0  # tokens 2..5 in the 2 s after the first
    assert t.end_to_end_tokens_per_s == pytest.approx(5 / 3)


def test_speed_on_smollm2_reports_consistent_figures(smollm2_folder):
    r = run_speed(str(smollm2_folder), new_tokens=6, repeats=1, log=lambda _: None, bandwidth_megabytes=128)
    assert r["native_tokens_per_s"] > 0 and r["transformers_tokens_per_s"] > 0
    assert r["ratio"] == pytest.approx(r["native_tokens_per_s"] / r["transformers_tokens_per_s"], rel=1e-2)
    assert r["fraction_of_limit"] == pytest.approx(r["native_tokens_per_s"] / r["limit_tokens_per_s"], rel=1e-2)
    for side in ("native", "transformers"):  # the prefill is timed, and apart from the rate
        assert r[f"{side}_prefill_s"] > 0
        rate, prefill = r[f"{side}_tokens_per_s"], r[f"{side}_prefill_s"]
        assert r[f"{side}_end_to_end_tokens_per_s"] == pytest.approx(6 / (prefill + 5 / rate), rel=2e-2)
    assert "of the limit" in format_speed(r)


def test_speed_refuses_a_length_with_no_decoding_step(smollm2_folder):
    with pytest.raises(SpecDecodeError, match="new-tokens >= 2"):
        run_speed(str(smollm2_folder), new_tokens=1, log=lambda _: None)
