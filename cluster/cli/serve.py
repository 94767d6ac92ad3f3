"""`tpserve serve`: run the Serve application on a local Ray (default) or an existing cluster."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from dataclasses import replace
from pathlib import Path

from cluster.app_config import ServeConfig
from cluster.options import add_engine_arguments, add_serve_arguments, engine_config

logger = logging.getLogger(__name__)

# Serve's by-value transport: requests and streamed chunks go over gRPC between Serve's proxy and
# the replicas and between replicas, not through Ray's object store (a part of what Ray's
# throughput-optimized mode turns on). Read by each Serve process as it starts, so it is set on
# every node: here for the local Ray `tpserve serve` starts, in the image (deploy/docker) and in
# the `ray start` commands of deploy/ray for a cluster.
SERVE_TRANSPORT_ENV = {"RAY_SERVE_USE_GRPC_BY_DEFAULT": "1"}


def use_serve_transport() -> None:
    """`SERVE_TRANSPORT_ENV` in this process's environment, so the local Ray it starts inherits
    it; a value the user set (``RAY_SERVE_USE_GRPC_BY_DEFAULT=0``: the object store) is kept."""
    for name, value in SERVE_TRANSPORT_ENV.items():
        os.environ.setdefault(name, value)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help="serve a model with an OpenAI-compatible API")
    add_engine_arguments(parser)
    add_serve_arguments(parser)
    parser.add_argument("--address", default=None,
                        help="join this Ray cluster instead of starting a local one")
    parser.add_argument("--grpc-port", type=int, default=9000,
                        help="gRPC API port, on every interface (default 9000; 0: none); with "
                             "--config, the file's grpc_options")
    parser.add_argument("--config", type=Path, default=None,
                        help="a Serve config file (deploy/ray/serve.yaml): its application's args "
                             "and http_options replace the other options (only --address mixes)")
    parser.set_defaults(func=run, seed=None)
    parser.set_defaults(option_defaults=vars(parser.parse_args([])))


def run(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from cluster.app import build_app, check_serve_config
    from cluster.api.grpc_service import grpc_options
    from cluster.serve_config import plan_from_cli, plan_from_file

    if args.config is not None:
        plan = plan_from_file(args.config, changed_options(args))
    else:
        plan = replace(plan_from_cli(args, engine_config(args)),
                       grpc_options=grpc_options(args.grpc_port))
    check_serve_config(plan.config)  # before Ray starts: a bad configuration never deploys
    if args.address:
        ray.init(address=args.address)
    else:
        keep_off_rank_cores(plan.config)  # before Ray starts: its processes inherit the cores
        use_serve_transport()  # and the environment
        ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False)
    try:
        serve.start(http_options={"host": plan.host, "port": plan.port},
                    grpc_options=plan.grpc_options)
        try:
            serve.run(build_app(plan.config, ray.cluster_resources()), name=plan.app_name,
                      route_prefix=plan.route_prefix)
        except RuntimeError as exc:  # Serve gave up on a deployment (its replicas kept failing)
            print(f"tpserve serve: error: the application failed to deploy: {exc}",
                  file=sys.stderr)
            return 1
        grpc = plan.grpc_options or {}
        also = f" and gRPC on port {grpc['port']}" if grpc.get("grpc_servicer_functions") else ""
        print(f"tpserve: serving on {plan.base_url}{also} (Ctrl-C stops)", flush=True)
        return _serve_until_stopped(plan.app_name)
    finally:
        from cluster.groups.allocator import kill_group_allocator
        from cluster.metrics import kill_metrics_store

        serve.shutdown()
        kill_metrics_store()  # detached, so it would outlive the app on a shared cluster
        kill_group_allocator()  # and so would the plan's placement groups
        ray.shutdown()


def keep_off_rank_cores(config: ServeConfig) -> None:
    """This process, and so the local Ray it starts and every process of the server but the
    ranks, on the cores the app's CPU ranks will leave unclaimed (`parallel.cpu_binding`); the
    ranks claim theirs from all of the node's cores (``$TPSERVE_NODE_CPUS``)."""
    import torch

    from parallel.cpu_binding import (NODE_CPUS_ENV, format_cpu_list, node_cpus, pin_process,
                                      serving_cores)

    engine = config.engine
    on_gpus = engine.device == "cuda" or (engine.device == "auto" and torch.cuda.is_available())
    if engine.cpu_binding != "auto" or on_gpus:
        return
    cpus = node_cpus()
    # one core per rank: a served rank runs one torch thread (cluster.app.group_resources)
    cores = serving_cores(engine.tp_size * config.max_groups, cpus=cpus)
    if cores is None:
        logger.info("CPU binding: Ray's processes stay on every core: the groups' %d ranks "
                    "and one core for the rest need more than this node's %d",
                    engine.tp_size * config.max_groups, len(cpus))
        return
    try:
        pin_process(cores)
    except OSError as exc:  # a core this process may not run on ($TPSERVE_NODE_CPUS)
        logger.warning("CPU binding: Ray's processes stay on every core: cores %s: %s",
                       format_cpu_list(cores), exc)
        return
    os.environ[NODE_CPUS_ENV] = format_cpu_list(cpus)
    logger.info("CPU binding: Ray's processes on core(s) %s, the ranks' cores claimed from %s",
                format_cpu_list(cores), format_cpu_list(cpus))


def changed_options(args: argparse.Namespace) -> list:
    """The options given a value other than their default (refused beside --config)."""
    defaults = args.option_defaults
    return sorted(name for name, default in defaults.items()
                  if name not in ("config", "address", "func", "seed", "option_defaults")
                  and getattr(args, name) != default)


def _serve_until_stopped(app_name: str, check_every_s: float = 5.0) -> int:
    """Until SIGINT or SIGTERM (exit 0), or until Serve reports that the application failed to
    deploy (exit 1, saying why); a group replaced after a failure is not a deploy failure."""
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(check_every_s):
        app = serve.status().applications.get(app_name)
        if app is not None and app.status == ApplicationStatus.DEPLOY_FAILED:
            print(f"tpserve serve: error: the application failed to deploy: {app.message}",
                  file=sys.stderr)
            return 1
    return 0
