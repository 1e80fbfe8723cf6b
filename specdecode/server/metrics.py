"""The server's Prometheus metrics (prometheus_client), in a registry of its own.

Speculation counters carry vLLM's names under our prefix (`specdecode:spec_decode_num_drafts`,
`..._num_draft_tokens`, `..._num_accepted_tokens`, `..._num_accepted_tokens_per_pos` with
a `position` label), so a dashboard built for vLLM reads them with the prefix changed.
The rest say what a capacity planner asks: requests running and waiting, the batch's size,
the k the goodput controller chose and the gain it expected, time to first token,
inter-token latency, tokens in and out.
"""

from __future__ import annotations

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector,
                               disable_created_metrics, generate_latest)

disable_created_metrics()  # no `_created` series beside every counter: dashboards do not read them

PREFIX = "specdecode:"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes and the like (Linux)
        labels, values = ["model_name"], [model_name]

        def make(kind, name, doc, extra=(), **kw):
            metric = kind(PREFIX + name, doc, labels + list(extra), registry=self.registry, **kw)
            return metric if extra else metric.labels(*values)

        self.num_drafts = make(Counter, "spec_decode_num_drafts", "Speculative rounds that drafted at least one token")
        self.num_draft_tokens = make(Counter, "spec_decode_num_draft_tokens", "Draft tokens proposed")
        self.num_accepted_tokens = make(Counter, "spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self._accepted_per_pos = make(Counter, "spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by position in the draft", ["position"])
        self.running = make(Gauge, "num_requests_running", "Sequences in the running batch")
        self.waiting = make(Gauge, "num_requests_waiting", "Requests queued for a place in the batch")
        self.batch_size = make(Histogram, "batch_size", "Sequences per decoding step",
                               buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64))
        self.controller_k = make(Gauge, "spec_decode_controller_k", "The longest draft the goodput controller "
                                 "chose for the last step (0: speculation off)")
        self.controller_gain = make(Gauge, "spec_decode_controller_expected_gain",
                                    "Goodput the controller expected of its k, over plain decoding of the batch")
        self.steps = make(Counter, "decode_steps", "Batched target passes after prefill", ["speculation"])
        self.ttft = make(Histogram, "time_to_first_token_seconds", "Time from arrival to the first token",
                         buckets=LATENCY_BUCKETS)
        self.itl = make(Histogram, "inter_token_latency_seconds", "Time between output tokens",
                        buckets=LATENCY_BUCKETS)
        self.prompt_tokens = make(Counter, "prompt_tokens", "Prompt tokens prefilled")
        self.generation_tokens = make(Counter, "generation_tokens", "Tokens generated")
        self.finished = make(Counter, "request_success", "Requests finished, by reason", ["finished_reason"])
        self.aborted = make(Counter, "request_aborted", "Requests whose client went away before the end")
        self.rejected = make(Counter, "request_rejected", "Requests turned away, by reason", ["reason"])
        self._model = model_name

    def observe_round(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted == 0:
            return
        self.num_drafts.inc()
        self.num_draft_tokens.inc(num_drafted)
        self.num_accepted_tokens.inc(num_accepted)
        for position in range(num_accepted):
            self._accepted_per_pos.labels(self._model, str(position)).inc()

    def observe_tokens(self, count: int, gap_s: float | None) -> None:
        """count tokens out, gap_s after the previous ones (None for the first)."""
        self.generation_tokens.inc(count)
        if gap_s is not None and count:
            for _ in range(count):  # a round's tokens arrive together: each waited gap / count
                self.itl.observe(gap_s / count)

    def finish(self, reason: str) -> None:
        self.finished.labels(self._model, reason).inc()

    def reject(self, reason: str) -> None:
        self.rejected.labels(self._model, reason).inc()

    def step(self, batch: int, speculating: bool) -> None:
        self.batch_size.observe(batch)
        self.steps.labels(self._model, "on" if speculating else "off").inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
