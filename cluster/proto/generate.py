"""Regenerate the gRPC API's Python modules from ``tpserve/v1/tpserve.proto``.

    python -m cluster.proto.generate            # rewrite the committed modules in place
    python -m cluster.proto.generate --out DIR  # write them under DIR (the test compares)

The modules are committed: Serve's gRPC proxy imports ``tpserve_pb2_grpc`` when it starts,
wherever Ray runs, so they must exist without a build step. The proto is compiled from the
repository root, so the generated import is ``cluster.proto.tpserve.v1``. Needs ``grpcio-tools``
(a dev dependency, pinned: its protoc version is written into the generated files).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List

REPO = Path(__file__).resolve().parents[2]
PROTO = Path("cluster/proto/tpserve/v1/tpserve.proto")  # relative to REPO
GENERATED = ("tpserve_pb2.py", "tpserve_pb2.pyi", "tpserve_pb2_grpc.py")


def generate(out_dir: Path) -> List[Path]:
    """Compile the proto into ``out_dir`` (mirroring the repository layout); the paths written.

    Raises ``RuntimeError`` with protoc's exit status when compilation fails."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    args = ["grpc_tools.protoc", f"-I{REPO}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", str(REPO / PROTO)]
    status = protoc.main(args)
    if status != 0:
        raise RuntimeError(f"protoc failed on {PROTO} with exit status {status}")
    return [out_dir / PROTO.parent / name for name in GENERATED]


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO,
                        help="root to write under (default: the repository, in place)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
