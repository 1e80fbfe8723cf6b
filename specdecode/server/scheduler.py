"""The server's decoding loop, in a thread of its own.

Requests wait in a bounded queue, join the running batch between steps (each prefilled
alone, core/batch.py), and leave it when done or when their client goes away: a
cancelled sequence is dropped before the next step, and its cache goes with it. Every
step is one target pass for the whole batch. A request asks for speculation `auto` (the
goodput controller's k for this batch, policy/goodput.py), a fixed k, or none.

Everything a request needs to hear (its rounds, its end, or a failure) goes through its
`deliver` callback, which the web layer makes thread-safe. A failure inside a step fails
the sequences of that step with a message and leaves the loop running.
A request with a tree drafter (Medusa, EAGLE) runs through `engine.decode`, one round per
step, in a batch of one (the server is started with --max-batch 1 for them).
Left out: prefill in chunks interleaved with decoding (a long prompt holds the batch
back while it is read), and preemption when memory runs short.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator

from specdecode.core.batch import Sequence, prefill, step
from specdecode.core.engine import decode
from specdecode.core.events import Done, Round, Stats
from specdecode.errors import SpecDecodeError
from specdecode.policy.goodput import GoodputController
from specdecode.server.metrics import ServerMetrics

log = logging.getLogger("specdecode")

AUTO = None  # a request's speculation mode: AUTO, False (plain) or a fixed k


class QueueFull(Exception):
    pass


@dataclass(frozen=True)
class Finished:
    reason: str  # "eos", "stop" or "length"
    stats: Stats


@dataclass(frozen=True)
class Failed:
    message: str
    status: int = 500  # 400: the request's fault (a SpecDecodeError), 500: the server's


@dataclass
class Job:
    seq: Sequence
    deliver: Callable[[Round | Finished | Failed], None]
    mode: bool | int | None = AUTO
    arrived: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    last_token_at: float | None = None
    alone: Iterator | None = None  # a tree drafter's generation (engine.decode), one round per step
    # a sampled request with its own seed: steered from its own acceptance and max_tokens only,
    # not from what the server learned of other answers, so that sent again it draws the same
    repeatable: bool = False

    @property
    def is_tree(self) -> bool:
        return self.seq.drafter is not None and self.seq.drafter.is_tree

    def k(self, auto_k: int) -> int:
        """This step's draft length, given the one the controller chose for it."""
        if self.seq.drafter is None or self.mode is False:
            return 0
        return auto_k if self.mode is AUTO else int(self.mode)


class Scheduler:
    def __init__(self, target, controller: GoodputController | None, metrics: ServerMetrics, max_batch: int,
                 max_queue: int):
        self.target = target  # the model's forward (a NativeModel or the transformers adapter)
        self.controller = controller
        self.metrics = metrics
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="specdecode-batch", daemon=True)

    # ---- called from the web layer -------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Finish what is running and waiting, then end the loop."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout)

    def submit(self, job: Job) -> None:
        with self._wake:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests are already waiting")
            self.waiting.append(job)
            self.metrics.waiting.set(len(self.waiting))
            self._wake.notify()

    def cancel(self, job: Job) -> None:
        """The client went away: the job leaves before the next step."""
        job.cancelled = True
        with self._wake:
            self._wake.notify()

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    # ---- the loop ---------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._wake:
                while self.idle and not self._stopping:
                    self._wake.wait()
                if self.idle and self._stopping:
                    return
                admitted = [self.waiting.popleft() for _ in range(min(len(self.waiting),
                                                                      self.max_batch - len(self.running)))]
                self.metrics.waiting.set(len(self.waiting))
            for job in admitted:
                self._admit(job)
            self._drop_cancelled()
            if self.running:
                try:
                    self._step()
                except Exception as error:  # a fault in one step must not take the server down
                    log.exception("a decoding step failed")
                    for job in self.running:
                        job.deliver(Failed(f"decoding failed: {error}"))
                    self.running = []
            self.metrics.running.set(len(self.running))

    def _admit(self, job: Job) -> None:
        if job.cancelled:
            self.metrics.aborted.inc()
            return
        if job.is_tree:
            seq = job.seq
            job.alone = decode(self.target, seq.prompt_ids, seq.stop, seq.sampling, seq.drafter, 0, seq.generator)
            if self._advance_alone(job):
                self.metrics.ttft.observe(time.perf_counter() - job.arrived)
                self.metrics.prompt_tokens.inc(len(seq.prompt_ids))
                self.running.append(job)
            return
        if self._steered(job) and not job.repeatable:  # until its drafts are judged: as recent answers did
            job.seq.policy.prior_alpha = self.controller.answers.alpha(job.seq.policy.prior_alpha)
        try:
            first = prefill(self.target, job.seq)
        except SpecDecodeError as error:
            job.deliver(Failed(str(error), 400))
            return
        except Exception as error:
            log.exception("a prefill failed")
            job.deliver(Failed(f"prefill failed: {error}"))
            return
        now = time.perf_counter()
        self.metrics.ttft.observe(now - job.arrived)
        self.metrics.prompt_tokens.inc(len(job.seq.prompt_ids))
        self._deliver(job, first, now)
        if not job.seq.done:
            self.running.append(job)

    def _steered(self, job: Job) -> bool:
        """Whether the controller chooses the job's k (its policy is then an AdaptiveK)."""
        return self.controller is not None and job.mode is AUTO and job.seq.drafter is not None and not job.is_tree

    def _tokens_left(self, job: Job) -> float:
        """What the job may still emit, as the controller prices a catch-up."""
        emitted, budget = len(job.seq.new_tokens), job.seq.stop.max_new_tokens
        return budget - emitted if job.repeatable else self.controller.answers.remaining(emitted, budget)

    def _drop_cancelled(self) -> None:
        for job in self.running:
            if job.cancelled:
                self.metrics.aborted.inc()
        self.running = [job for job in self.running if not job.cancelled]

    def _advance_alone(self, job: Job) -> bool:
        """One event of a tree job's generation; whether it goes on."""
        try:
            event = next(job.alone)
        except Exception as error:  # SpecDecodeError: a bad request; anything else: a fault
            job.deliver(Failed(str(error), 400) if isinstance(error, SpecDecodeError)
                        else Failed(f"decoding failed: {error}"))
            return False
        now = time.perf_counter()
        if isinstance(event, Done):
            job.seq.finish_reason, job.seq.stats = event.reason, event.stats
            self.metrics.finish(event.reason)
            job.deliver(Finished(event.reason, event.stats))
            return False
        job.seq.new_tokens += event.token_ids
        self.metrics.observe_round(event.num_drafted, event.num_accepted)
        gap = None if job.last_token_at is None else now - job.last_token_at
        self.metrics.observe_tokens(len(event.token_ids), gap)
        job.last_token_at = now
        job.deliver(event)
        return True

    def _step(self) -> None:
        trees = [job for job in self.running if job.is_tree]
        if trees:  # a batch of one (serve sets --max-batch 1 for tree drafters)
            self.metrics.step(len(self.running), True)
            self.running = [job for job in self.running if not job.is_tree or self._advance_alone(job)]
            return
        auto = [job for job in self.running if self._steered(job)]
        chosen = {}
        if auto:  # steered jobs exist only with a controller
            others = [1 + job.k(0) for job in self.running if job not in auto]
            catch_up = [(job.seq.drafter.unread(job.seq.context), self._tokens_left(job)) for job in auto]
            lengths = self.controller.choose([job.seq.policy.alpha for job in auto], others, catch_up)
            chosen = {id(job): k for job, k in zip(auto, lengths)}
            self.metrics.controller_k.set(self.controller.k)
            self.metrics.controller_gain.set(self.controller.gain)
        ks = [job.k(chosen.get(id(job), 0)) for job in self.running]
        rounds = step(self.target, [job.seq for job in self.running], ks)
        self.metrics.step(len(self.running), any(ks))
        now = time.perf_counter()
        for job, round_ in zip(self.running, rounds):
            self.metrics.observe_round(round_.num_drafted, round_.num_accepted)
            self._deliver(job, round_, now)
        self.running = [job for job in self.running if not job.seq.done]

    def _deliver(self, job: Job, round_: Round, now: float) -> None:
        gap = None if job.last_token_at is None else now - job.last_token_at
        self.metrics.observe_tokens(len(round_.token_ids), gap)
        job.last_token_at = now
        job.deliver(round_)
        if job.seq.done:
            if self.controller is not None:
                policy = job.seq.policy  # AdaptiveK for AUTO jobs: what the target accepted, as the controller reads it
                judged = (policy.accepted, policy.positions) if self._steered(job) else ()
                self.controller.answers.add(len(job.seq.new_tokens), *judged)
            job.seq.stats.wall_s = now - job.arrived
            self.metrics.finish(job.seq.finish_reason)
            job.deliver(Finished(job.seq.finish_reason, job.seq.stats))
