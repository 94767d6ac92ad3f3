"""The router's ranking of a uniform fleet in one C call (``cluster/routing/csrc/native_rank.c``): the
prefix walk of `cluster.routing.prefix_index.PrefixIndex.prefix_split` and the ranking of
`cluster.routing.uniform_rank.rank_uniform`, with the same result, Placement for Placement.

    module = load()                        # None where it cannot be built (logged once)
    state = fleet_state(index, fleet, settings)   # once per fleet; None: rank in Python
    ranks, order, committed, prefix, base, num_blocks, hashes = module.rank(
        state, block_hashes, num_tokens, block_size)

Why: a routing decision runs between engine steps, with the ingress's caches cold, and there
each Python function a decision enters costs a fetch of its code and data. With 64 groups the
two Python functions this replaces were most of a cold decision (``scripts/bench_router.py``,
docs/benchmarks/router-decision.md). The Python ones stay: they are what a test checks this
against, and what runs where this does not (no compiler or no ``Python.h``, fleets of over 64
groups, a fleet bit above 2**63, a request whose demand the C call refuses, which the Python
path then names).

Built on first use by `kv.native_build.build_shared` as a CPython extension (``-O2``, no
``-march=native``, and ``-ffp-contract=off``: no fused multiply-add, so scores are Python's
doubles bit for bit). ``TPSERVE_NATIVE_ROUTER=0`` turns it off.
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import logging
import os
import sysconfig
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Optional, Tuple

from kv.native_build import KernelBuildError, build_shared

if TYPE_CHECKING:
    from cluster.routing.load_report import FleetLoads
    from cluster.routing.prefix_index import PrefixIndex
    from cluster.routing.settings import RouterSettings

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "native_rank.c"
HEADERS = (SOURCE.with_name("prefix_table.h"),)  # the prefix index's C mirror
MODULE_NAME = "tpserve_native_rank"  # PyInit_ in the source
SWITCH_ENV = "TPSERVE_NATIVE_ROUTER"
MAX_GROUPS = 64  # a fleet's bits must fit one 64-bit mask


def compile_flags() -> Tuple[str, ...]:
    return ("-O2", "-fPIC", "-ffp-contract=off", "-fno-strict-aliasing",
            f"-I{sysconfig.get_paths()['include']}")


@functools.lru_cache(maxsize=None)
def load() -> Optional[ModuleType]:
    """The compiled module, built or loaded once per process; None where it cannot be."""
    if os.environ.get(SWITCH_ENV, "1").lower() in ("0", "false", "off", "no"):
        logger.info("router: %s=0, uniform fleets rank in Python", SWITCH_ENV)
        return None
    try:
        path = build_shared(SOURCE, compile_flags(), ("-shared",), headers=HEADERS)
        loader = importlib.machinery.ExtensionFileLoader(MODULE_NAME, str(path))
        spec = importlib.util.spec_from_file_location(MODULE_NAME, path, loader=loader)
        assert spec is not None
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except (KernelBuildError, OSError, ImportError) as exc:
        logger.warning("router: the C ranking is not used, uniform fleets rank in Python "
                       "(slower): %s", exc)
        return None
    return module


def fleet_state(index: "PrefixIndex", fleet: "FleetLoads",
                settings: "RouterSettings") -> Optional[tuple]:
    """What ``rank`` reads of a fleet ranked by `rank_uniform` (``fleet.kept`` set), holding the
    fleet's own lists (moved in place by charges); None where the C call cannot rank it."""
    kept = fleet.kept
    if (kept is None or index.table is None or len(fleet.loads) > MAX_GROUPS
            or fleet.bits >> MAX_GROUPS):
        return None
    bit_index = [-1] * MAX_GROUPS
    for bit, i in fleet.index_of_bit.items():
        bit_index[bit.bit_length() - 1] = i
    first = fleet.loads[0]
    return (index.table, fleet.bits, bit_index, kept.order, kept.committed, kept.tie, fleet.ranks,
            first.block_size, first.num_blocks_total, float(settings.target_occupancy),
            float(settings.prefix_weight), float(settings.load_weight),
            settings.load_scale == "target")
