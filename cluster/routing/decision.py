"""What the KV-aware router decided for a request, kept until a replica accepts it, and the
labels of the decisions that did not rank (metric labels of ``tpserve:router_decisions`` beside
`cluster.routing.ranking.RankReason`'s values)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

from ray.serve.request_router import ReplicaID

from cluster.routing.fleet_order import UniformRanking
from cluster.routing.ranking import RankedGroup
from kv.prefix_hash import BlockHash

FALLBACK_NO_NUM_TOKENS = "fallback_no_num_tokens"  # no num_tokens kwarg: not a generation call
FALLBACK_BAD_DEMAND = "fallback_bad_demand"  # num_tokens / block_hashes unusable
FALLBACK_NO_REPORTS = "fallback_no_reports"  # no replica has reported its load yet
NO_REPORT = "no_report"  # placed on a replica without a report (every reported one was full)
NO_HEALTHY_GROUP = "no_healthy_group"  # every replica reported a dead engine: none is ranked


@dataclass
class PendingDecision:
    """What choose_replicas decided for a request, kept until a replica accepts it."""

    num_tokens: int
    ranked: Optional[Sequence[RankedGroup]]  # None: fallback (reason below)
    fallback_reason: str = NO_REPORT
    charged: Optional[ReplicaID] = None  # the replica charged for it on the decision
    block_hashes: Tuple[BlockHash, ...] = ()  # its prompt's, noted where it is accepted
    block_size: int = 1
    first_tokens: Optional[int] = None  # tokens_on(the first choice), where known already

    def tokens_on(self, group_id: str) -> int:
        """What the request adds to ``group_id``'s pool: its tokens less the blocks of its prefix
        the group has cached (as ranked; all of them where it was not ranked)."""
        return max(0, self.num_tokens - self.cached_on(group_id) * self.block_size)

    def cached_on(self, group_id: str) -> int:
        """The request's leading blocks ``group_id`` holds, as ranked (0 where not ranked)."""
        ranked = self.ranked
        if isinstance(ranked, UniformRanking):
            return ranked.cached_blocks_of(group_id)
        return next((p.cached_prefix_blocks or 0 for p in ranked or ()
                     if p.group_id == group_id), 0)

    def longest_cached(self) -> Tuple[int, str]:
        """The most leading request blocks any ranked group holds, and that group's reason
        (the first such in rank order; (0, "") without a ranking)."""
        ranked = self.ranked
        if isinstance(ranked, UniformRanking):
            return ranked.longest_cached()
        best = max(ranked or (), key=lambda p: p.cached_prefix_blocks or 0, default=None)
        return (best.cached_prefix_blocks or 0, best.reason.value) if best else (0, "")
