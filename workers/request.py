"""A request's state inside the engine: its tokens, how many are in the KV cache, its blocks' hashes."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, List, NewType, Optional

import torch

from kv.prefix_hash import BlockHash
from workers.sampler import SampledToken
from workers.sampling_params import SamplingParams

if TYPE_CHECKING:
    from workers.structured.matcher import RequestGrammar

RequestId = NewType("RequestId", str)


@dataclass(frozen=True)
class SwappedTail:
    """A preempted request's partly filled last block, kept in a private host slot."""

    host_slot: int
    block_index: int  # its place in the block table
    num_tokens: int  # tokens of KV it holds
    tag: int  # checksum tag: the hash of its tokens chained on the previous block


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"  # admitted, waiting for its prefix to come back from host or disk
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"


@dataclass(eq=False)
class Request:
    request_id: RequestId
    seq_id: int  # compact id used in step plans
    prompt_token_ids: List[int]
    params: SamplingParams
    generator: torch.Generator
    eos_token_ids: tuple = ()
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: List[int] = field(default_factory=list)
    output_logprobs: List[SampledToken] = field(default_factory=list)
    all_token_ids: List[int] = field(default_factory=list)
    block_hashes: List[BlockHash] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: Optional[FinishReason] = None
    is_known_to_ranks: bool = False  # ranks mirror its block table
    num_blocks_sent: int = 0  # blocks of its table the ranks already have
    num_preemptions: int = 0
    swapped_tail: Optional[SwappedTail] = None
    first_token_time: Optional[float] = None
    # Choices of one request (``n`` > 1) share the prompt: choice 0 computes it, the others
    # wait until it has, then take its blocks from the prefix cache.
    parent_id: Optional[RequestId] = None  # the id the caller knows (default: request_id)
    index: int = 0  # which choice
    prefill_leader: Optional["Request"] = None
    # Its place in its grammar (``params.structured``), on the sampling rank; None when done.
    grammar: Optional["RequestGrammar"] = None
    # Tokens sampled on the device whose ids the host does not know yet (the overlapped step
    # loop): the last ``num_pending`` entries of ``all_token_ids`` are placeholders (see
    # ``add_pending``), and ``final_pending`` says the last of them ends the request by length.
    num_pending: int = 0
    final_pending: bool = False

    @property
    def waits_for_leader(self) -> bool:
        leader = self.prefill_leader
        return (leader is not None and not leader.is_finished
                and leader.num_computed_tokens < leader.num_prompt_tokens)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        if self.parent_id is None:
            self.parent_id = self.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids the host knows: all but the pending ones."""
        return len(self.all_token_ids) - self.num_pending

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def resume(self, output_token_ids: List[int]) -> None:
        """Start from tokens another engine produced (a migrated request): they are output
        already, computed again here like a preempted request's."""
        assert not self.output_token_ids, "resume a request before it runs"
        self.output_token_ids.extend(output_token_ids)
        self.all_token_ids.extend(output_token_ids)

    def add_pending(self, row: int, max_model_len: int) -> None:
        """A token was sampled for this request in row ``row`` of a step's sampled ids, which
        are still on the device. It counts as a token from now on (the next step computes it
        from the device), standing in ``all_token_ids`` as ``placeholder(row)`` until
        ``append_token`` gives its id."""
        self.all_token_ids.append(placeholder(row))
        self.num_pending += 1
        self.final_pending = (len(self.output_token_ids) + self.num_pending
                              >= self.params.max_tokens or self.num_tokens >= max_model_len)

    def append_token(self, sampled: SampledToken) -> None:
        """The next output token; it takes the place of the oldest pending one if any."""
        self.output_token_ids.append(sampled.token_id)
        if self.num_pending:
            self.all_token_ids[len(self.all_token_ids) - self.num_pending] = sampled.token_id
            self.num_pending -= 1
            self.final_pending = self.final_pending and self.num_pending > 0
        else:
            self.all_token_ids.append(sampled.token_id)
        if self.params.logprobs is not None:
            self.output_logprobs.append(sampled)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()

    def stop_reason_for_last_token(self) -> Optional[FinishReason]:
        """Whether the token just appended ends the request (stop strings are checked elsewhere)."""
        token = self.output_token_ids[-1]
        num_output = len(self.output_token_ids)
        if num_output >= self.params.min_tokens:
            if token in self.params.stop_token_ids:
                return FinishReason.STOP
            if not self.params.ignore_eos and token in self.eos_token_ids:
                return FinishReason.STOP
        if num_output >= self.params.max_tokens:
            return FinishReason.LENGTH
        return None


def placeholder(row: int) -> int:
    """The stand-in id of a token sampled in row ``row`` of the previous step's sampled ids: a
    negative number, which no tokenizer produces. The model runner takes the id from the device."""
    return -1 - row
