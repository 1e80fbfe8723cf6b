"""`specdecode check`: the statistics (against scipy, and their false-alarm rate measured),
and the check itself on tiny random models: it passes on lossless configurations and
fails when a lossy acceptance rule is swapped in, sampled or greedy."""

from __future__ import annotations

import json
import random
import shutil
import sys
import time

import pytest
import torch

from specdecode.commands import check as check_module
from specdecode.commands.check import CheckSettings, SharedPrefill, run_check
from specdecode.commands.check_report import format_check
from specdecode.commands.cli import build_parser, main
from specdecode.core.conformance import (bonferroni, chi2_sf, chi2_statistic, count_table, homogeneity, pool_rare,
                                         total_variation)
from specdecode.core.engine import decode
from specdecode.core.events import collect
from specdecode.core.sampling import SamplingConfig
from specdecode.core.stopping import StopCondition
from specdecode.errors import SpecDecodeError
from specdecode.models.native import NativeModel
from specdecode.questions import Question

scipy_stats = pytest.importorskip("scipy.stats")


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from threads, and on a busy machine two threads that wait
    for each other make every step many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def draws(probs: list[float], n: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.multinomial(torch.tensor(probs), n, replacement=True, generator=generator).tolist()


# ---- statistics --------------------------------------------------------------------------

@pytest.mark.parametrize("table", [
    [[10, 20, 30], [15, 25, 20]],
    [[120, 80], [95, 105]],
    [[5, 9, 40, 11, 7], [12, 3, 38, 14, 6]],
    [[300, 2, 50, 48], [250, 10, 80, 60]],
])
def test_chi_square_matches_scipy(table):
    statistic, df = chi2_statistic(table)
    expected = scipy_stats.chi2_contingency(table, correction=False)
    assert statistic == pytest.approx(expected.statistic, rel=1e-10)
    assert df == expected.dof
    assert chi2_sf(statistic, df) == pytest.approx(expected.pvalue, rel=1e-9)


def test_the_tail_matches_scipy_far_out():
    for df in (1, 2, 5, 17, 60):
        for statistic in (0.0, 0.3, 4.0, 25.0, 90.0, 250.0):
            assert chi2_sf(statistic, df) == pytest.approx(scipy_stats.chi2.sf(statistic, df), rel=1e-8, abs=1e-300)
    assert chi2_sf(3.0, 0) == 1.0


def test_pooling_leaves_no_expected_count_under_five():
    rng = random.Random(0)
    for _ in range(200):
        columns = rng.randint(1, 30)
        table = [[rng.choice([0, 0, 1, 2, 3, 8, 40]) for _ in range(columns)] for _ in range(2)]
        if min(sum(row) for row in table) == 0:
            continue
        pooled = pool_rare(table)
        rows = [sum(row) for row in pooled]
        assert rows == [sum(row) for row in table]  # nothing is lost
        if len(pooled[0]) > 1:
            total = sum(rows)
            assert min(r * (a + b) / total for a, b in zip(*pooled) for r in rows) >= 5.0


def test_identical_distributions_alarm_at_the_nominal_rate():
    """Two samples of one distribution with a long tail of rare tokens: p < 0.05 about 5%
    of the time, not more (the pooling keeps the approximation honest)."""
    probs = [0.3, 0.2, 0.15, 0.1, 0.05] + [0.2 / 40] * 40
    p_values = [homogeneity(draws(probs, 200, 2 * i), draws(probs, 200, 2 * i + 1)).p_value for i in range(300)]
    false_alarms = sum(p < 0.05 for p in p_values) / len(p_values)
    assert 0.015 <= false_alarms <= 0.09, false_alarms
    assert sum(p < 0.2 for p in p_values) / len(p_values) < 0.3  # roughly uniform, not piled up near 0


def test_different_distributions_give_tiny_p_values():
    a = draws([0.5, 0.3, 0.2], 400, 0)
    b = draws([0.3, 0.3, 0.4], 400, 1)
    result = homogeneity(a, b)
    assert result.p_value < 1e-8 and result.df == 2 and result.bins == 3
    assert 0.15 < result.tv_distance < 0.25  # the true distance is 0.2


def test_total_variation_on_known_counts():
    a = [0] * 50 + [1] * 30 + [2] * 20
    b = [0] * 20 + [1] * 30 + [3] * 50
    assert total_variation(a, b) == pytest.approx(0.5)
    assert total_variation(a, list(reversed(a))) == 0.0
    assert total_variation([7] * 10, [8] * 3) == 1.0


def test_one_category_is_no_evidence():
    result = homogeneity([4] * 30, [4] * 20)
    assert (result.p_value, result.df, result.bins, result.tv_distance) == (1.0, 0, 1, 0.0)
    categories, table = count_table([1, 1, 2], [2, 3])
    assert categories == [1, 2, 3] and table == [[2, 1, 0], [0, 1, 1]]
    assert bonferroni(0.01, 8) == pytest.approx(0.00125)


# ---- the check on tiny models -----------------------------------------------------------

PROMPTS = [Question("copy", "code-edit", ("def add(a, b): return a + b  # rename add to plus: def plus(a, b): ",)),
           Question("prose", "chat", ("Why is the sky blue? Explain it to a child, briefly.",))]
CHARACTERS = [chr(c) for c in range(32, 127)]  # 95, with [UNK]: the tiny models' 96 rows


def with_tokenizer(source: str, folder) -> str:
    """A copy of a tiny model folder with a character-level tokenizer of its vocabulary."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    shutil.copytree(source, folder)
    vocab = {"[UNK]": 0, **{ch: i + 1 for i, ch in enumerate(CHARACTERS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]").save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def tiny_pair(tiny_llama, tiny_llama_other, tmp_path_factory):
    root = tmp_path_factory.mktemp("check")
    return with_tokenizer(tiny_llama, root / "target"), with_tokenizer(tiny_llama_other, root / "draft")


def settings(target, **overrides) -> CheckSettings:
    return CheckSettings(**{"target": target, "drafter": "prompt-lookup", "k": 3, "greedy_tokens": 24,
                            "samples": 300, "positions": 3, **overrides})


def test_check_passes_with_prompt_lookup_and_a_draft_model(tiny_pair):
    target, draft = tiny_pair
    for flags in ({"drafter": "prompt-lookup"}, {"drafter": None, "draft": draft}):
        # alpha 0.001: on another CPU the kernels round differently and the draws differ; a
        # lossless configuration then fails one run in a thousand, not one in a hundred
        result = run_check(settings(target, sampled_prompts=2, alpha=0.001, **flags), PROMPTS)
        assert result["passed"], format_check(result)
        assert all(case["identical"] and case["drafted"] > 0 for case in result["greedy"])
        assert len(result["sampled"]) == 2 * 3 and result["tests"] == 6
        assert all(d["drafted"] > 100 and d["accepted"] > 0 for d in result["sampled_drafting"])  # it was exercised
        assert result["bonferroni_threshold"] == pytest.approx(0.001 / 6)
        assert format_check(result).splitlines()[-1].startswith("PASS: greedy output identical on 2/2")


def test_check_catches_a_lossy_sampling_rule(tiny_pair):
    target, draft = tiny_pair
    for flags in ({"drafter": "prompt-lookup"}, {"drafter": None, "draft": draft}):
        result = run_check(settings(target, **flags), PROMPTS, lossy_rule_for_testing="sampled")
        assert not result["passed"]
        assert all(case["identical"] for case in result["greedy"])  # the greedy rule is intact
        failed = [t for t in result["sampled"] if t["failed"]]
        assert failed and min(t["p_value"] for t in failed) < 1e-5, format_check(result)
        assert max(t["tv_distance"] for t in result["sampled"]) > 0.2
        assert format_check(result).splitlines()[-1].startswith("FAIL: ")


def test_check_catches_a_lossy_greedy_rule(tiny_pair):
    _, draft = tiny_pair
    target = tiny_pair[0]
    result = run_check(settings(target, drafter=None, draft=draft, samples=60), PROMPTS,
                       lossy_rule_for_testing="greedy")
    assert not result["passed"]
    differ = [case for case in result["greedy"] if not case["identical"]]
    assert differ and all(case["margin"] > 0 for case in differ)  # a real argmax was overruled
    assert all(case["plain_token"] != case["speculative_token"] for case in differ)
    assert "DIFFERS at token" in format_check(result)


def test_temperature_zero_checks_greedy_only(tiny_pair):
    result = run_check(settings(tiny_pair[0], temperature=0.0), PROMPTS[:1])
    assert result["passed"] and result["sampled"] == [] and result["tests"] == 0
    assert "sampled check skipped" in result["summary"]


def test_without_the_native_cache_the_plain_runs_go_through_the_engine(tiny_pair, monkeypatch):
    class NoCache:  # no cache is one: neither the shared prefill nor the batched plain runs apply
        pass

    monkeypatch.setattr(check_module, "KVCache", NoCache)
    result = run_check(settings(tiny_pair[0], samples=150, positions=2), PROMPTS[:1])
    assert result["passed"], format_check(result)
    lossy = run_check(settings(tiny_pair[0], samples=150, positions=2), PROMPTS[:1], lossy_rule_for_testing="sampled")
    assert not lossy["passed"]


def test_the_shared_prefill_gives_what_a_fresh_one_gives(tiny_pair):
    model = NativeModel.from_folder(tiny_pair[0], torch.bfloat16)
    shared = SharedPrefill(model)
    prompt = [5, 17, 42, 8, 17, 42, 8, 91]
    stop = StopCondition(max_new_tokens=12)
    sampling = SamplingConfig(0.8)

    def run(target, seed):
        return collect(decode(target, prompt, stop, sampling, None, 0, torch.Generator().manual_seed(seed)))[0]

    fresh = [run(model, seed) for seed in range(6)]
    assert [run(shared, seed) for seed in range(6)] == fresh  # the first computes the prefill, the rest reuse it
    assert len(set(map(tuple, fresh))) > 1


# ---- the command line --------------------------------------------------------------------

@pytest.mark.parametrize("flags, message", [
    (["--drafter", "prompt-lookup", "--samples", "0"], "--samples must be an integer >= 10"),
    (["--drafter", "prompt-lookup", "--alpha", "1.5"], "--alpha must be in (0, 1)"),
    (["--drafter", "prompt-lookup", "--alpha", "0"], "--alpha must be in (0, 1)"),
    (["--drafter", "prompt-lookup", "--positions", "0"], "--positions must be an integer >= 1"),
    (["--drafter", "prompt-lookup", "--greedy-tokens", "0"], "--greedy-tokens must be an integer >= 1"),
    (["--drafter", "prompt-lookup", "--temperature", "-1"], "temperature must be"),
    (["--drafter", "prompt-lookup", "--top-p", "0"], "must be in (0, 1]"),
    (["--drafter", "prompt-lookup", "--samples", "9"], "--samples must be an integer >= 10"),
    (["--drafter", "prompt-lookup", "--k", "0"], "k must be >= 1"),
    (["--drafter", "medusa", "--k", "3"], "--k does not apply to medusa"),
    ([], "name a drafter"),
])
def test_bad_flags_exit_2_before_anything_loads(flags, message, capsys, monkeypatch):
    monkeypatch.setattr(check_module, "load_model", lambda *a: pytest.fail("a model was loaded"))
    started = time.perf_counter()
    assert main(["check", "--target", "no-such-model", *flags]) == 2
    assert time.perf_counter() - started < 2.0
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    # the API refuses the same settings (the command line checks them before torch loads)
    args = build_parser().parse_args(["check", *flags])
    settings = CheckSettings(args.target, args.draft, args.drafter, args.k, args.heads, args.profile, args.dtype,
                             args.temperature, args.top_k, args.top_p, args.greedy_tokens, args.samples,
                             args.positions, args.alpha, args.seed, args.sampled_prompts)
    with pytest.raises(SpecDecodeError):
        settings.validate()


def test_the_command_line_defaults_are_the_settings_defaults():
    args = build_parser().parse_args(["check", "--drafter", "prompt-lookup"])
    defaults = CheckSettings()
    for name in ("target", "temperature", "top_k", "top_p", "greedy_tokens", "samples", "positions", "alpha",
                 "seed", "sampled_prompts"):
        assert getattr(args, name) == getattr(defaults, name), name


def test_the_command_exits_0_on_a_pass_and_1_on_a_failure_with_json(tiny_pair, tmp_path, capsys, monkeypatch):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"question_id": q.question_id, "category": q.category,
                                             "turns": list(q.turns)}) for q in PROMPTS))
    flags = ["check", "--target", tiny_pair[0], "--drafter", "prompt-lookup", "--k", "3", "--prompts", str(prompts),
             "--samples", "200", "--positions", "2", "--sampled-prompts", "1", "--greedy-tokens", "16", "--json"]
    assert main(flags) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["passed"] is True and out["config"]["drafter"] == "prompt-lookup" and out["tests"] == 2
    assert [case["prompt"] for case in out["greedy"]] == ["copy", "prose"]
    assert out["summary"].startswith("PASS")

    real_run_check = check_module.run_check
    monkeypatch.setattr(check_module, "run_check",
                        lambda *a, **kw: real_run_check(*a, **kw, lossy_rule_for_testing="both"))
    assert main(flags) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["passed"] is False and out["summary"].startswith("FAIL")


@pytest.mark.real
def test_check_on_smollm2_with_prompt_lookup_passes():
    prompt = Question("copy", "code-edit", ("Rename x to width: def f(x): return x * 2 if x > 0 else -x",))
    result = run_check(CheckSettings("smollm2-135m-instruct", drafter="prompt-lookup", k=4, greedy_tokens=24,
                                     samples=100, positions=2), [prompt])
    assert result["passed"], format_check(result)
    assert result["greedy"][0]["drafted"] > 0 and result["sampled_drafting"][0]["drafted"] > 0
