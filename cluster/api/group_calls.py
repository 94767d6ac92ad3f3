"""The ingress's requests to the TP groups: a checked request's prompts (one, or a batch's) each
sent through the group deployment's handle, routed by its token count and block hashes
(``generate(request, num_tokens=T, block_hashes=H)``, a `cluster.contract.GroupRequest`), and
read back as one `RequestRun`.

A batch holds a generation slot per prompt (`IngressAdmission`), its prompts run as separate
engine requests (``<id>-<p>``) whose chunks are merged (`MergedStreams`). Each prompt's call
also gets a Serve request id of its own: Serve and the KV-aware router key a routed call by the
HTTP request's id, which all the calls made in that request share. What the router is
charged for a request's output comes from the lengths of finished ones (`OutputLengthEstimate`).
"""

from __future__ import annotations

import contextvars
import dataclasses
import uuid
from typing import Any, Callable, List, Optional, Sequence

from ray import serve
from ray.serve.handle import DeploymentHandle

from cluster.api.admission import IngressAdmission
from cluster.api.metrics import IngressMetrics, RequestTimer
from cluster.api.prompts import PromptCodec
from cluster.api.request_run import GroupStream, MergedStreams, MigrationPolicy, RequestRun
from cluster.api.protocol import CompletionFormat, ProtocolError
from cluster.routing.output_length import OutputLengthEstimate, router_charge
from cluster.api.request_limits import DeadlineStream
from cluster.api.tools.plan import ToolPlan
from cluster.contract import GroupRequest
from kv.prefix_hash import extend_block_hashes
from workers.request import RequestId
from workers.sampling_params import SamplingParams


class GroupRequests:
    def __init__(self, group_handle: DeploymentHandle, block_size: int, prompts: PromptCodec,
                 metrics: IngressMetrics, migration: MigrationPolicy,
                 admission: IngressAdmission) -> None:
        self._group = group_handle.options(stream=True)
        self.block_size = block_size
        self.prompts = prompts
        self.metrics = metrics
        self._migration = migration
        self._admission = admission
        self._output_lengths = OutputLengthEstimate()  # what the router charges for outputs

    def start(self, fmt: CompletionFormat, body: Any, max_tokens: List[int],
              prompt_ids: List[List[int]], timer: RequestTimer, echo: Sequence[str] = (), *,
              timeout_s: float, release: Callable[[], None],
              tools: Optional[ToolPlan] = None) -> RequestRun:
        """Send each prompt to a TP group: one run of all their choices (prompt p's choice j
        is choice ``p * n + j``). ``release`` (the request's admission slot) is called when the
        run ends; a batch takes its other slots here (429 when not free). ``tools``: a chat
        request's tool calling (its grammar goes to the engine, its parsers into the run)."""
        release = self._batch_slots(len(prompt_ids), release)
        try:
            return self._start(fmt, body, max_tokens, prompt_ids, timer, echo, timeout_s,
                               release, tools)
        except BaseException:
            release()
            raise

    def _start(self, fmt: CompletionFormat, body: Any, max_tokens: List[int],
               prompt_ids: List[List[int]], timer: RequestTimer, echo: Sequence[str],
               timeout_s: float, release: Callable[[], None],
               tools: Optional[ToolPlan]) -> RequestRun:
        samplings = [with_tool_grammar(request_sampling(body, m), tools) for m in max_tokens]
        self.prompts.check_token_ids(list(samplings[0].logit_bias), "logit_bias")
        n, batched = samplings[0].n, len(prompt_ids) > 1
        streams: List[GroupStream] = []
        try:
            for p, (ids, sampling, m) in enumerate(zip(prompt_ids, samplings, max_tokens)):
                streams.append(self._send(f"{fmt.request_id}-{p}" if batched
                                          else fmt.request_id, ids, sampling, m, batched))
        except BaseException:  # the prompts already sent are aborted in their groups
            for stream in streams:
                stream.cancel()
            raise

        def on_end(run: RequestRun, outcome: Optional[str]) -> None:
            release()
            self._record(run, outcome)

        merged = MergedStreams(streams, n) if batched else streams[0]
        stream = DeadlineStream(merged, timeout_s)  # the deadline covers the migrations too
        return RequestRun(fmt, stream, timer,  # type: ignore[arg-type]
                          sum(map(len, prompt_ids)), n * len(prompt_ids),
                          samplings[0].logprobs is not None, self.prompts.token_text, on_end,
                          echo=[text for text in echo for _ in range(n)],
                          continuous_usage=body.continuous_usage, tools=tools)

    def _batch_slots(self, num_prompts: int, release: Callable[[], None]
                     ) -> Callable[[], None]:
        """A batch holds a generation slot per prompt: those beyond the request's own are
        taken now and given back with it."""
        if num_prompts == 1:
            return release
        more = self._admission.acquire(num_prompts - 1, held=1)

        def release_all() -> None:
            release()
            more()
        return release_all

    def _send(self, request_id: str, prompt_ids: List[int], sampling: SamplingParams,
              max_tokens: int, own_serve_id: bool = False) -> GroupStream:
        """One prompt to a TP group, routed by its token count and block hashes; with
        ``own_serve_id`` (a batch's prompt), as a Serve request of its own."""
        request = GroupRequest(RequestId(request_id), tuple(prompt_ids), sampling)
        n = sampling.n
        charge = router_charge(len(prompt_ids), n, max_tokens, self._output_lengths)
        block_hashes = extend_block_hashes([], prompt_ids, self.block_size)

        def start(resume: List[int]):  # again, resumed, when the group serving it failed
            sent = request.resumed(resume) if resume else request
            call = lambda: self._group.generate.remote(sent, num_tokens=charge,  # noqa: E731
                                                       block_hashes=block_hashes)
            return in_own_serve_request(call) if own_serve_id else call()

        return GroupStream(start([]), n, restart=start if self._migration.max_migrations
                           else None, policy=self._migration,
                           on_migrate=self.metrics.record_migration)

    def _record(self, run: RequestRun, outcome: Optional[str]) -> None:
        reason = outcome or run.finish_reason or "abort"
        if outcome is None:  # finished in the group: a sample of how long outputs run
            for choice in run.choices:
                if choice.finish_reason is not None:
                    self._output_lengths.record(choice.num_output_tokens)
        self.metrics.record(run.timer, run.num_prompt_tokens, run.num_output_tokens, reason)


def in_own_serve_request(call: Callable[[], Any]) -> Any:
    """``call()`` (a handle call) under a Serve request id of its own, in a copy of the
    request's context: the calls of one HTTP request otherwise share its id, and Serve's
    routing and the KV-aware router's charges (`cluster.groups.deployment.serve_routing_id`)
    would take them for one call (a batch's second prompt was never routed)."""
    def run() -> Any:
        serve.context._set_request_context(_internal_request_id=uuid.uuid4().hex)
        return call()
    return contextvars.copy_context().run(run)


def with_tool_grammar(sampling: SamplingParams, tools: Optional[ToolPlan]) -> SamplingParams:
    """``sampling`` constrained by the tool plan's grammar, if it has one; a request cannot
    have both that grammar and a structured output of its own (400)."""
    if tools is None or tools.structured is None:
        return sampling
    if sampling.structured is not None:
        raise ProtocolError("tool_choice: a required or named tool choice is enforced by a "
                            "grammar, and the request asks for a structured output too; drop "
                            "one of them", param="tool_choice")
    return dataclasses.replace(sampling, structured=tools.structured)


_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def request_sampling(body: Any, max_tokens: int) -> SamplingParams:
    """The request's sampling for a prompt of ``max_tokens``; the engine's checks of it fail
    as a 400 naming the field."""
    try:
        return body.sampling(max_tokens)
    except ValueError as exc:
        message = str(exc)
        first_word = message.split(" ", 1)[0].rstrip(":")
        raise ProtocolError(message,
                            param=first_word if first_word in _SAMPLING_FIELDS else None) from None
