"""The server's decoding loop and its controller, in-process on a tiny model: what finished
answers teach the controller about the sequences that come after them."""

from __future__ import annotations

import threading

import pytest
import torch

from specdecode.core.batch import Sequence
from specdecode.core.sampling import SamplingConfig
from specdecode.core.stopping import StopCondition
from specdecode.drafters import PromptLookup
from specdecode.models.native import NativeModel
from specdecode.policy.adaptive import AdaptiveK, CostModel
from specdecode.policy.goodput import GoodputController, PassCosts
from specdecode.server.metrics import ServerMetrics
from specdecode.server.scheduler import AUTO, Finished, Job, Scheduler
from tests.conftest import require_kernel

FREE_ROWS = PassCosts({1: 0.01, 16: 0.01, 64: 0.1})  # up to 16 rows cost one: drafting pays alone


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    require_kernel()  # the batched pass runs on the fused kernels
    return NativeModel.from_folder(tiny_llama, torch.bfloat16)


def run(scheduler: Scheduler, prompts: list[list[int]], new_tokens: int, seeded: bool = False) -> list[Job]:
    """Each prompt as an AUTO request, one after another (`seeded`: sampled with a seed of
    its own); the jobs once all are done."""
    jobs = []
    for prompt in prompts:
        done = threading.Event()
        seq = Sequence(prompt, StopCondition(frozenset(), max_new_tokens=new_tokens), drafter=PromptLookup(),
                       policy=AdaptiveK(CostModel(0.0), k_max=4), k_max=4)
        if seeded:
            seq.sampling, seq.generator = SamplingConfig(temperature=1.0), torch.Generator().manual_seed(7)
        job = Job(seq, lambda event, done=done: isinstance(event, Finished) and done.set(), AUTO, repeatable=seeded)
        scheduler.submit(job)
        assert done.wait(60), "the request did not finish"
        jobs.append(job)
    return jobs


def test_answers_that_finish_set_the_next_requests_prior_and_expected_length(tiny):
    controller = GoodputController(FREE_ROWS, k_max=4)
    scheduler = Scheduler(tiny, controller, ServerMetrics("tiny"), max_batch=2, max_queue=4)
    scheduler.start()
    try:
        repetitive = [5, 17, 42, 8] * 6  # prompt lookup keeps finding its continuation
        first, second = run(scheduler, [repetitive, repetitive[1:]], new_tokens=24)
        seeded, = run(scheduler, [repetitive], new_tokens=24, seeded=True)
    finally:
        scheduler.stop(10)
    assert list(controller.answers.lengths) == [24, 24, 24]
    assert first.seq.policy.prior_alpha == 0.6  # nothing seen yet: the policy's own prior
    judged = first.seq.policy.accepted / first.seq.policy.positions
    assert second.seq.policy.prior_alpha == pytest.approx(judged) and judged != 0.6
    assert first.seq.stats.draft_tokens > 0
    # a seeded sampled request draws the same when sent again: nothing learned steers it
    assert seeded.seq.policy.prior_alpha == 0.6
