"""The router's ranking of a uniform fleet (`cluster.routing.fleet_order`) in one C call
(``cluster/routing/csrc/native_rank.c``): the prefix walk of
`cluster.routing.prefix_index.PrefixIndex` and a fast path of the one policy,
`cluster.routing.ranking.rank_groups`, with the same result, group for group (checked on
generated fleets: tests/cluster/test_native_rank.py).

    module = load()                        # None where it cannot be loaded (logged once)
    state = fleet_state(index, fleet, settings)   # once per fleet; None: rank in Python
    ranks, order, committed, prefix, base, num_blocks, hashes, first_tokens = module.rank(
        state, block_hashes, num_tokens, block_size)

Why: a routing decision runs between engine steps, with the ingress's caches cold, and there
each Python function a decision enters costs a fetch of its code and data (docs/benchmarks/router-decision.md
has the decision times). `rank_groups` runs where this does not: the C extension not loaded, fleets
of over 64 groups, a fleet bit above 2**63, a request whose demand the C call refuses (which the
Python path then names).

A CPython extension built with the package by ``setup.py`` (``LIBRARY``, beside this file, in the
wheel and in an editable install's checkout): ``-O2``, no ``-march``, and ``-ffp-contract=off``:
no fused multiply-add, so scores are Python's doubles bit for bit. Where it is missing (built
without a compiler) or was built from other sources (`kv.native_stamp`), it is compiled on first
use by `kv.native_build.build_shared` with the same flags, and a warning says so.
``TPSERVE_NATIVE_ROUTER=0`` turns it off.
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import logging
import sysconfig
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Optional, Tuple

from kv.native_build import (KernelBuildError, build_shared, load_shipped_or_built,
                             switched_off)

if TYPE_CHECKING:
    from cluster.routing.load_report import FleetLoads
    from cluster.routing.prefix_index import PrefixIndex
    from cluster.routing.settings import RouterSettings

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "native_rank.c"
HEADERS = (SOURCE.with_name("prefix_table.h"),)  # the prefix index's C mirror
MODULE_NAME = "tpserve_native_rank"  # PyInit_ in the source
# Built with the package (setup.py), for this Python.
LIBRARY = Path(__file__).with_name(MODULE_NAME + sysconfig.get_config_var("EXT_SUFFIX"))
SWITCH_ENV = "TPSERVE_NATIVE_ROUTER"
MAX_GROUPS = 64  # a fleet's bits must fit one 64-bit mask


def compile_flags() -> Tuple[str, ...]:
    return ("-O2", "-fPIC", "-ffp-contract=off", "-fno-strict-aliasing",
            f"-I{sysconfig.get_paths()['include']}")


def build() -> Path:
    """The extension compiled at first use, where `LIBRARY` cannot be used (cached as
    `kv.native_build.build_shared` says). Raises `KernelBuildError` naming the command."""
    return build_shared(SOURCE, compile_flags(), ("-shared",), headers=HEADERS)


def _load_extension(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(MODULE_NAME, str(path))
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=None)
def load() -> Optional[ModuleType]:
    """The compiled module, loaded (or built) once per process; None where it cannot be."""
    if switched_off(SWITCH_ENV):
        logger.info("router: %s=0, uniform fleets rank in Python", SWITCH_ENV)
        return None
    try:
        module, why_built = load_shipped_or_built(LIBRARY, (SOURCE, *HEADERS), _load_extension,
                                                  build)
    except KernelBuildError as exc:
        logger.warning("router: the C ranking is not used, uniform fleets rank in Python "
                       "(slower): %s", exc)
        return None
    if why_built:
        logger.warning("router: %s; the C ranking was compiled at first use instead: %s",
                       why_built, module.__file__)
    return module


def fleet_state(index: "PrefixIndex", fleet: "FleetLoads",
                settings: "RouterSettings") -> Optional[tuple]:
    """What ``rank`` reads of a uniform fleet (``fleet.kept`` set), holding the
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
            float(settings.prefix_weight), float(settings.load_weight))
