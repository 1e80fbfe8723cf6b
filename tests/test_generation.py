"""Plain and speculative generation on real models, against transformers and each other,
and the front ends' answers to bad input."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdecode.commands.cli import main
from specdecode.drafters import PromptLookup
from specdecode.core.engine import decode
from specdecode.errors import SpecDecodeError, UnknownModelError
from specdecode.core.events import collect
from specdecode.models.load import eos_token_ids
from specdecode.models.native import NativeModel
from specdecode.core.prompts import encode_prompt
from specdecode.core.stopping import StopCondition

CODE_PROMPT = "Write a Python function that returns the n-th Fibonacci number."
PROSE_PROMPT = "Describe, in a few sentences, what a lighthouse keeper's day was like."


def native_greedy(model, prompt_ids, eos, n, **kw) -> list[int]:
    stop = StopCondition(frozenset(eos), max_new_tokens=n)
    return collect(decode(model, prompt_ids, stop, **kw))[0]


def check_plain_equals_transformers(folder, n=32):
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    eos = eos_token_ids(folder, tokenizer)
    prompt_ids = encode_prompt(tokenizer, CODE_PROMPT)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids])
    expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                           eos_token_id=list(eos), pad_token_id=eos[0])[0, len(prompt_ids):].tolist()
    del hf  # keep one fp32 copy in memory at a time
    got = native_greedy(NativeModel.from_folder(folder, torch.float32), prompt_ids, eos, n)
    assert got == expected
    assert len(got) == n or got[-1] in eos


@pytest.mark.real
def test_smollm2_greedy_equals_transformers_generate(smollm2_folder):
    check_plain_equals_transformers(smollm2_folder)


@pytest.mark.qwen
def test_qwen_1_5b_greedy_equals_transformers_generate(qwen_folder):
    check_plain_equals_transformers(qwen_folder)


@pytest.mark.qwen
@pytest.mark.parametrize("prompt", [CODE_PROMPT, PROSE_PROMPT], ids=["code", "prose"])
def test_qwen_pair_speculative_greedy_is_identical_to_plain(prompt):
    from specdecode.api import load_model
    from specdecode.plan import make_draft_model

    target = load_model("qwen2.5-coder-1.5b-instruct")
    draft = load_model("qwen2.5-coder-0.5b-instruct")
    prompt_ids = encode_prompt(target.tokenizer, prompt)
    eos = target.info.eos_token_ids
    plain = native_greedy(target.model, prompt_ids, eos, 40)
    for k in (1, 3, 8):
        spec = native_greedy(target.model, prompt_ids, eos, 40, drafter=make_draft_model(target, draft), k=k)
        assert spec == plain, f"k={k}"
    assert native_greedy(target.model, prompt_ids, eos, 40, drafter=PromptLookup(), k=4) == plain


@pytest.mark.qwen
def test_qwen_shipped_medusa_heads_are_exact_and_accepted():
    """The Medusa heads shipped for the default target work on a machine that never trained
    them: greedy output equals plain decoding, and the heads draft well on code."""
    from specdecode.api import load_model
    from specdecode.heads import artifacts, draft_vocab
    from specdecode.heads.medusa import model as medusa_artifact
    from specdecode.heads.medusa.drafter import MedusaDrafter

    target = load_model("qwen2.5-coder-1.5b-instruct")
    heads, config = medusa_artifact.load(artifacts.SHIPPED / "qwen2.5-coder-1.5b-instruct" / "medusa")
    drafter = MedusaDrafter(target.model, heads, [tuple(p) for p in config.tree],
                            draft_vocab.for_target(target, heads.draft_vocab))
    prompt_ids = encode_prompt(target.tokenizer, CODE_PROMPT)
    stop = StopCondition(frozenset(target.info.eos_token_ids), max_new_tokens=48)
    plain = collect(decode(target.model, prompt_ids, stop))[0]
    tokens, done = collect(decode(target.model, prompt_ids, stop, drafter=drafter))
    assert tokens == plain
    assert done.stats.mean_accepted_length > 1.6  # 1.9 over the code-completion suite, on two nodes


@pytest.mark.real
def test_mismatched_tokenizer_is_refused(tiny_llama):
    from specdecode.api import Model, load_model
    from specdecode.plan import make_draft_model
    from specdecode.models.load import ModelInfo

    smol = load_model("smollm2-135m-instruct")
    other = AutoTokenizer.from_pretrained(str(smol.info.folder))
    other.add_tokens(["<an-extra-token>"])
    impostor = Model(smol.model, other, ModelInfo("x", smol.info.folder, None, (2,)))
    with pytest.raises(SpecDecodeError, match="tokenizer"):
        make_draft_model(smol, impostor)


def test_unknown_model_is_refused():
    with pytest.raises(UnknownModelError, match="smollm2-135m-instruct"):
        from specdecode.api import load_model

        load_model("no-such-model")


@pytest.mark.real
@pytest.mark.parametrize("argv, message", [
    (["--prompt", "   "], "prompt is empty"),
    (["--prompt", "hi", "--max-new-tokens", "-1"], "--max-new-tokens"),
    (["--prompt", "hi", "--drafter", "prompt-lookup", "--k", "0"], "k must be"),
    (["--prompt", "hi", "--drafter", "prompt-lookup", "--draft", "smollm2-135m-instruct"], "does not go with"),
    (["--prompt", "hi", "--temperature", "-1"], "temperature"),
    (["--prompt", "word " * 9000], "context"),
    (["--prompt", "hi", "--drafter", "medusa", "--k", "3"], "does not apply"),
    (["--prompt", "hi", "--drafter", "eagle", "--head", "/nonexistent"], "no EAGLE head"),
    (["--prompt", "hi", "--drafter", "medusa", "--heads", "/nonexistent"], "no Medusa heads"),
    (["--prompt", "hi", "--drafter", "prompt-lookup", "--heads", "/x"], "goes with --drafter medusa or eagle"),
])
def test_cli_bad_input_gives_one_clear_error(capsys, argv, message):
    assert main(["generate", "--target", "smollm2-135m-instruct", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("specdecode: error:") and message in err[0]


@pytest.mark.parametrize("argv, message", [
    (["bench", "--tree-widths", "4x4"], "at most 10 nodes"),
    (["bench", "--tree-widths", "2xa"], "widths per depth"),
    (["train", "medusa", "--heads", "0"], "must be positive"),
    (["train", "eagle", "--epochs", "0"], "must be positive"),
    (["train", "medusa", "--from", "/x"], "--from goes with --reshape-only"),
    (["tune", "--drafters", "nope"], "--drafters must name"),
    (["export", "medusa", "--out", "/tmp/x", "--k", "3"], "--k and --format go with export eagle"),
    (["export", "eagle", "--out", "/tmp/x", "--k", "0"], "--k must be at least 1"),
    (["import", "eagle", "/nonexistent", "--target", "smollm2-135m-instruct"], "no config.json in /nonexistent"),
])
def test_cli_bad_options_give_one_clear_error(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("specdecode: error:") and message in err[0]


def test_cli_unknown_model(capsys):
    assert main(["generate", "--target", "no-such-model", "--prompt", "hi"]) == 2
    assert "known models" in capsys.readouterr().err


@pytest.mark.real
def test_cli_generate_json(capsys):
    assert main(["generate", "--target", "smollm2-135m-instruct", "--prompt", "Say hello.", "--json",
                 "--drafter", "prompt-lookup", "--max-new-tokens", "12"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) >= {"text", "token_ids", "stats"} and result["text"]
    for field in ("rounds", "draft_tokens", "accepted_tokens", "acceptance_rate", "mean_accepted_length", "wall_s"):
        assert field in result["stats"]
    assert len(result["token_ids"]) <= 12


@pytest.mark.real
def test_transformers_style_generate_call():
    from specdecode.api import load_model

    target = load_model("smollm2-135m-instruct")
    inputs = target.tokenizer("def fibonacci(n):", return_tensors="pt")
    plain = target.generate(**inputs, max_new_tokens=24)
    assert plain.shape[1] <= inputs["input_ids"].shape[1] + 24
    assert torch.equal(plain[0, :inputs["input_ids"].shape[1]], inputs["input_ids"][0])
    assisted = target.generate(**inputs, assistant_model=target, max_new_tokens=24)
    lookup = target.generate(**inputs, prompt_lookup_num_tokens=3, max_new_tokens=24)
    assert torch.equal(assisted, plain) and torch.equal(lookup, plain)
    with pytest.raises(SpecDecodeError, match="not both"):
        target.generate(**inputs, assistant_model=target, prompt_lookup_num_tokens=3)


@pytest.mark.real
def test_adaptive_k_and_profiles_keep_greedy_output(tmp_path):
    import specdecode
    from specdecode.policy.profile import Profile

    prompt = "Add type hints to this function:\ndef area(width, height):\n    return width * height\n"
    options = dict(max_new_tokens=32, target="smollm2-135m-instruct")
    plain = specdecode.generate(prompt, **options)
    auto = specdecode.generate(prompt, drafter="prompt-lookup", k="auto", **options)
    profile = Profile("smollm2-135m-instruct", "bfloat16", {1: 0.02, 4: 0.021, 8: 0.022},
                      {"prompt-lookup": {"draft": None, "step_s": 0.0001}})
    profile.decide("code-edit", {"prompt-lookup": 0.7})
    path = profile.save(tmp_path / "profile.json")
    tuned = specdecode.generate(prompt, profile=str(path), category="code-edit", **options)
    assert auto.token_ids == plain.token_ids == tuned.token_ids
    assert auto.stats.draft_tokens > 0 and tuned.stats.draft_tokens > 0
    with pytest.raises(SpecDecodeError, match="not both"):
        specdecode.generate(prompt, drafter="prompt-lookup", k=3, profile=str(path), **options)


@pytest.mark.real
def test_smollm2_medusa_and_draft_tree_greedy_are_identical_to_plain():
    """Medusa with the heads shipped in the package; SmolLM2 drafting a tree for itself."""
    import specdecode

    prompt = "Write a Python function that checks whether a number is prime."
    options = dict(max_new_tokens=48, target="smollm2-135m-instruct")
    plain = specdecode.generate(prompt, **options)
    medusa = specdecode.generate(prompt, drafter="medusa", **options)
    tree = specdecode.generate(prompt, drafter="draft-tree", draft="smollm2-135m-instruct", **options)
    assert medusa.token_ids == plain.token_ids == tree.token_ids
    # the trained heads are right often enough, on the shipped tree of 4 nodes (the tree fitted
    # to this machine may be smaller, or none where drafting does not pay)
    from specdecode.heads import artifacts, draft_vocab
    from specdecode.heads.medusa import model as medusa_artifact
    from specdecode.api import load_model
    from specdecode.heads.medusa.drafter import MedusaDrafter
    from specdecode.core.engine import decode
    from specdecode.core.events import collect
    from specdecode.core.prompts import encode_prompt
    from specdecode.core.stopping import StopCondition

    target = load_model("smollm2-135m-instruct")
    heads, config = medusa_artifact.load(artifacts.SHIPPED / "smollm2-135m-instruct" / "medusa")
    shipped = MedusaDrafter(target.model, heads, [tuple(p) for p in config.tree],
                            draft_vocab.for_target(target, heads.draft_vocab))
    stop = StopCondition(frozenset(target.info.eos_token_ids), max_new_tokens=48)
    tokens, done = collect(decode(target.model, encode_prompt(target.tokenizer, prompt), stop, drafter=shipped))
    assert tokens == plain.token_ids and done.stats.mean_accepted_length > 1.3
    assert tree.stats.mean_accepted_length > 3.0  # the target drafting for itself: every depth holds
    with pytest.raises(SpecDecodeError, match="does not apply"):
        specdecode.generate(prompt, drafter="medusa", k=3, **options)


@pytest.mark.real
def test_smollm2_eagle_chain_and_dynamic_tree_greedy_are_identical_to_plain():
    """The EAGLE head shipped in the package, as a chain (top-1, 4 deep), as a dynamic tree
    (top-3, 3 deep, 8 nodes) and in the shape its artifact chose."""
    import specdecode
    from specdecode.api import load_model
    from specdecode.heads.loading import eagle_drafter
    from specdecode.heads.eagle.drafter import EagleDrafter
    from specdecode.core.engine import decode
    from specdecode.core.events import collect
    from specdecode.core.prompts import encode_prompt
    from specdecode.core.stopping import StopCondition

    prompt = "Write a Python function that returns the n-th Fibonacci number."
    target = load_model("smollm2-135m-instruct")
    ids = encode_prompt(target.tokenizer, prompt)
    stop = StopCondition(frozenset(target.info.eos_token_ids), max_new_tokens=48)
    plain, _ = collect(decode(target.model, ids, stop))
    shipped = eagle_drafter(target)
    chain = EagleDrafter(target.model, shipped.head, depth=4, top_k=1, num_nodes=4, vocab=shipped.vocab)
    tree = EagleDrafter(target.model, shipped.head, depth=3, top_k=3, num_nodes=8, vocab=shipped.vocab)
    for drafter in (chain, tree):
        tokens, done = collect(decode(target.model, ids, stop, drafter=drafter))
        assert tokens == plain
        assert done.stats.mean_accepted_length > 1.3
    assert specdecode.generate(prompt, target="smollm2-135m-instruct", drafter="eagle",
                               max_new_tokens=48).token_ids == plain
