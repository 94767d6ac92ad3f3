"""`tpserve topology probe|parse|plan`: what a node reports, and the TP groups nodes would get.

    tpserve topology probe [--json]
    tpserve topology parse [--nvidia-smi FILE] [--ibstat FILE] [--json]
    tpserve topology plan --node NAME=NVSMI_FILE[,IBSTAT_FILE] ... --tp N [--groups G] [--json]
    tpserve topology plan --address ADDR --tp N [--groups G] [--json]   (the live cluster)
"""

from __future__ import annotations

import argparse
import json
from typing import Callable, Optional, TypeVar

from parallel.grouping import plan_groups
from parallel.topology import GpuTopology, NodeName, NodeTopology
from parallel.topology_parse import IBStatReport, parse_nvidia_smi_topo, read_ibstat
from parallel.topology_probe import probe_node

T = TypeVar("T")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("topology", help="probe nodes and plan TP groups")
    actions = parser.add_subparsers(dest="action", required=True)

    probe = actions.add_parser("probe", help="this node's GPUs, links, NICs and IB ports")
    probe.add_argument("--json", action="store_true", help="print JSON")
    probe.set_defaults(func=_probe)

    parse = actions.add_parser("parse", help="read saved `nvidia-smi topo -m` / `ibstat` output")
    parse.add_argument("--nvidia-smi", metavar="FILE", help="output of `nvidia-smi topo -m`")
    parse.add_argument("--ibstat", metavar="FILE", help="output of `ibstat`")
    parse.add_argument("--json", action="store_true", help="print JSON")
    parse.set_defaults(func=_parse)

    plan = actions.add_parser("plan", help="the TP groups for saved outputs or a live cluster")
    source = plan.add_mutually_exclusive_group(required=True)
    source.add_argument("--node", action="append", metavar="NAME=NVSMI[,IBSTAT]",
                        help="a node: its name, its `nvidia-smi topo -m` file and optionally its "
                             "`ibstat` file (repeat for each node)")
    source.add_argument("--address", metavar="ADDR",
                        help="probe every node of this Ray cluster (`auto`: the local one)")
    plan.add_argument("--tp", type=int, required=True, help="ranks per group")
    plan.add_argument("--groups", type=int, default=None,
                      help="number of groups (default: as many as fit)")
    plan.add_argument("--json", action="store_true", help="print JSON")
    plan.set_defaults(func=_plan)


def _probe(args: argparse.Namespace) -> int:
    node = probe_node()
    print(json.dumps(node.to_dict(), indent=2) if args.json else _describe(node))
    return 0


def _parse(args: argparse.Namespace) -> int:
    if not args.nvidia_smi and not args.ibstat:
        raise ValueError("nothing to parse: give --nvidia-smi FILE and/or --ibstat FILE")
    node = _node_from_files(NodeName("parsed"), args.nvidia_smi, args.ibstat)
    if args.json:
        data = node.to_dict()
        print(json.dumps({key: data[key] for key in ("gpus", "links", "nics", "ib_ports",
                                                     "warnings")}, indent=2))
    else:
        print(_describe(node))
    return 0


def _plan(args: argparse.Namespace) -> int:
    if args.address:
        plan = _plan_live(args.address, args.tp, args.groups)
    else:
        plan = plan_groups([_node_from_spec(spec) for spec in args.node], args.tp, args.groups)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print("\n".join(plan.explanation()))
    return 0


def _plan_live(address: str, tp_size: int, num_groups: Optional[int]):
    """Probe every node of the Ray cluster at `address` and plan as `tpserve serve` does."""
    import ray

    from cluster.groups.formation import FormationConfig, alive_nodes, gpu_budget, plan_placement
    from cluster.groups.formation import probe_cluster

    config = FormationConfig(tp_size=tp_size, num_groups=num_groups)  # checks the numbers first
    ray.init(address=address, logging_level="WARNING", log_to_driver=False)
    try:
        return plan_placement(probe_cluster(config.probe_timeout_s), config,
                              gpu_budget(alive_nodes()))
    finally:
        ray.shutdown()


def _node_from_spec(spec: str) -> NodeTopology:
    name, _, files = spec.partition("=")
    paths = [path for path in files.split(",") if path] if files else []
    if not name or not 1 <= len(paths) <= 2:
        raise ValueError(f"--node {spec!r}: expected NAME=NVSMI_FILE or "
                         "NAME=NVSMI_FILE,IBSTAT_FILE")
    return _node_from_files(NodeName(name), paths[0], paths[1] if len(paths) == 2 else None)


def _node_from_files(name: NodeName, nvidia_smi: Optional[str],
                     ibstat: Optional[str]) -> NodeTopology:
    gpus = _parse_file(nvidia_smi, parse_nvidia_smi_topo) if nvidia_smi else GpuTopology()
    ports = _parse_file(ibstat, read_ibstat) if ibstat else IBStatReport(())
    sources = tuple(f"file:{path}" for path in (nvidia_smi, ibstat) if path)
    return NodeTopology(name, gpus, ports.ports, sources=sources,
                        warnings=gpus.warnings + ports.warnings)


def _parse_file(path: str, parse: Callable[[str], T]) -> T:
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as exc:
        raise OSError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    try:
        return parse(text)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc


def _describe(node: NodeTopology) -> str:
    """A short human summary: the link matrix, the NICs and the IB ports."""
    lines = [f"node {node.name}: {len(node.gpus)} GPU(s), {node.num_cpu_cores or '?'} CPU "
             f"core(s), {node.num_numa_nodes or '?'} NUMA node(s); from {list(node.sources)}"]
    if node.gpus:
        lines.append(" " * 8 + "".join(f"{f'GPU{gpu.index}':<8}" for gpu in node.gpus) + "NUMA")
        for gpu, row in zip(node.gpus, node.links, strict=True):
            cells = "".join(f"{'X' if link is None else str(link):<8}" for link in row)
            numa = "?" if gpu.numa_node is None else gpu.numa_node
            lines.append(f"{f'GPU{gpu.index}':<8}{cells}{numa}")
    data = node.to_dict()
    for nic in data["nics"]:
        lines.append(f"NIC {nic['name']} ({nic['label']}): close to GPUs {nic['close_gpus']}")
    for port in node.ib_ports:
        lines.append(f"IB {port.device}:{port.port} {port.state}/{port.phys_state} "
                     f"{port.rate_gbps:g} Gb/s {port.link_layer}")
    lines += [f"warning: {warning}" for warning in node.warnings]
    return "\n".join(lines)
