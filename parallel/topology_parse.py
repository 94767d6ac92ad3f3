"""Parsers for what the topology tools print: `nvidia-smi topo -m`, `ibstat`, /sys/class/infiniband.

Pure functions of their text (or of a directory tree, for sysfs). They accept what real machines
print: a leading `# SOURCE:` line, tabs or spaces, indentation, with or without the legends, NIC
columns named `NICn` or by device (`mlx5_0`), CPU/NUMA affinity columns, ports down, and a tool's
error message after the output. Text they cannot read raises `ValueError` naming the line.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Optional

from parallel.topology import Gpu, GpuIndex, GpuTopology, IBPort, LinkClass, Nic

logger = logging.getLogger(__name__)

# Multi-word column titles, joined so that a header splits on any whitespace.
_AFFINITY_TITLES = {
    "CPU_AFFINITY": re.compile(r"CPU\s+Affinity", re.IGNORECASE),
    "NUMA_AFFINITY": re.compile(r"NUMA\s+Affinity", re.IGNORECASE),
    "GPU_NUMA_ID": re.compile(r"GPU\s+NUMA\s+ID", re.IGNORECASE),
}
_GPU_LABEL = re.compile(r"GPU(\d+)")
_NIC_LEGEND_ENTRY = re.compile(r"(NIC\d+)\s*:\s*(\S+)")
_LEGEND_TITLE = re.compile(r"(NIC\s+)?Legend\s*:", re.IGNORECASE)
_UNKNOWN = {"N/A", "NA", ""}


def _content_lines(text: str) -> list[tuple[int, str]]:
    """(1-based line number, line) for every line but a leading `# SOURCE:` comment."""
    lines = list(enumerate(text.splitlines(), start=1))
    if lines and lines[0][1].lstrip().startswith("# SOURCE:"):
        lines = lines[1:]
    return lines


_BUS_ID = re.compile(r"[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]")
_GPU_NAMED = re.compile(r"\bGPU\s?(\d{1,3})\b(?!:[0-9A-Fa-f]{2}:)")
_QUOTED = re.compile(r"'([^']+)'")
_HCA_NAMED = re.compile(r"\b((?:mlx\d+|mthca|hfi\d+|qib|bnxt_re|irdma|rxe)_?[A-Za-z0-9_]*)")
_IB_TOOL_MESSAGE = re.compile(r"(ibpanic|ibwarn|iberror|ibdebug|ibstat)\s*:", re.IGNORECASE)


def device_named(line: str) -> str:
    """The device an error line is about, as it names it: `GPU2 (0000:34:00.0)`, `GPU
    0000:CB:00.0`, `'mlx5_5'`, `mlx5_3`; or "a device it does not name"."""
    bus, gpu = _BUS_ID.search(line), _GPU_NAMED.search(line)
    if gpu and bus:
        return f"GPU{gpu.group(1)} ({bus.group(0)})"
    if bus:
        return f"GPU {bus.group(0)}"
    if gpu:
        return f"GPU{gpu.group(1)}"
    quoted = _QUOTED.search(line)
    if quoted:
        return quoted.group(1)
    hca = _HCA_NAMED.search(line)
    return hca.group(1) if hca else "a device it does not name"


def tool_warning(source: str, number: int, line: str) -> str:
    """A warning for an error line a tool printed among its output."""
    return (f"{source}: line {number}: the tool reported an error about {device_named(line)}: "
            f"{line.strip()!r}; only what it printed besides is used")


def _line_error(source: str, number: int, line: str, expected: str) -> ValueError:
    return ValueError(f"{source}: line {number}: cannot read {line.strip()!r}: expected {expected}")


# ---------------------------------------------------------------------------------------------
# nvidia-smi topo -m


@dataclass
class _Matrix:
    """The header's columns and the rows read so far."""

    device_labels: list[str]  # GPUn and NIC columns, in column order
    affinity_titles: list[str]  # the affinity columns after them
    rows: dict[str, tuple[list[LinkClass | None], list[str]]] = field(default_factory=dict)
    nic_names: dict[str, str] = field(default_factory=dict)

    @property
    def is_complete(self) -> bool:
        return len(self.rows) == len(self.device_labels)


def _read_header(line: str) -> Optional[_Matrix]:
    """The column titles of a header line, or None when the line is not a header."""
    for joined, pattern in _AFFINITY_TITLES.items():
        line = pattern.sub(joined, line)
    tokens = line.split()
    if not tokens or not _GPU_LABEL.fullmatch(tokens[0]):
        return None
    devices = [t for t in tokens if t not in _AFFINITY_TITLES]
    affinities = [t for t in tokens if t in _AFFINITY_TITLES]
    if tokens[: len(devices)] != devices or any(_is_cell(t) for t in devices):
        return None  # a matrix row, or a device column after an affinity column
    return _Matrix(devices, affinities)


def _is_cell(token: str) -> bool:
    try:
        LinkClass.parse(token)
    except ValueError:
        return token == "X"
    return True


def _read_row(matrix: _Matrix, number: int, line: str) -> None:
    tokens = line.split()
    label, cells = tokens[0], tokens[1:]
    source = "nvidia-smi topo -m"
    num_devices = len(matrix.device_labels)
    if label not in matrix.device_labels:
        raise _line_error(source, number, line, f"a row of one of {matrix.device_labels}")
    if label in matrix.rows:
        raise _line_error(source, number, line, f"one row for {label}, not two")
    if len(cells) < num_devices:
        raise _line_error(source, number, line,
                          f"{num_devices} link cells for {label}, found {len(cells)}")
    affinity = cells[num_devices:]
    if len(affinity) > len(matrix.affinity_titles):
        raise _line_error(source, number, line, f"{num_devices} link cells and at most "
                          f"{len(matrix.affinity_titles)} affinity values")
    links: list[LinkClass | None] = []
    for column, cell in zip(matrix.device_labels, cells[:num_devices], strict=True):
        if (cell == "X") != (column == label):
            raise _line_error(source, number, line, f"'X' exactly in column {label}")
        try:
            links.append(None if cell == "X" else LinkClass.parse(cell))
        except ValueError as exc:
            raise _line_error(source, number, line, f"link classes ({exc})") from None
    matrix.rows[label] = (links, affinity)


def _read_legend_entry(matrix: _Matrix, line: str) -> bool:
    match = _NIC_LEGEND_ENTRY.fullmatch(line.strip())
    if match:
        matrix.nic_names[match.group(1)] = match.group(2)
    return bool(match) or "=" in line


def parse_nvidia_smi_topo(text: str) -> GpuTopology:
    """Parse `nvidia-smi topo -m`. Lines before the header (driver warnings) and after the matrix
    and legends (a tool's error) are logged and skipped; a malformed matrix raises `ValueError`."""
    matrix: Optional[_Matrix] = None
    skipped: list[tuple[int, str]] = []
    for number, line in _content_lines(text):
        if not line.strip():
            continue
        if matrix is None:
            matrix = _read_header(line)
            if matrix is None:
                skipped.append((number, line))
        elif not matrix.is_complete:
            _read_row(matrix, number, line)
        elif not (_LEGEND_TITLE.match(line.strip()) or _read_legend_entry(matrix, line)):
            skipped.append((number, line))
    if matrix is None:
        number, line = skipped[0] if skipped else (1, text)
        raise _line_error("nvidia-smi topo -m", number, line,
                          "a header row of GPU columns (GPU0 GPU1 ... CPU Affinity)")
    if not matrix.is_complete:
        missing = [label for label in matrix.device_labels if label not in matrix.rows]
        raise ValueError(f"nvidia-smi topo -m: the matrix ends before the rows of {missing}")
    warnings = tuple(tool_warning("nvidia-smi topo -m", number, line) for number, line in skipped)
    for warning in warnings:
        logger.warning("%s", warning)
    return dataclasses.replace(_build_gpu_topology(matrix), warnings=warnings)


def _affinity_value(matrix: _Matrix, values: list[str], title: str) -> Optional[str]:
    if title not in matrix.affinity_titles:
        return None
    position = matrix.affinity_titles.index(title)
    value = values[position] if position < len(values) else ""
    return None if value.upper() in _UNKNOWN else value


def _build_gpu_topology(matrix: _Matrix) -> GpuTopology:
    gpu_columns = [i for i, label in enumerate(matrix.device_labels) if _GPU_LABEL.fullmatch(label)]
    nic_columns = [i for i in range(len(matrix.device_labels)) if i not in gpu_columns]
    gpus, links = [], []
    for column in gpu_columns:
        label = matrix.device_labels[column]
        row_links, affinity = matrix.rows[label]
        numa = _affinity_value(matrix, affinity, "NUMA_AFFINITY")
        gpus.append(Gpu(
            index=GpuIndex(int(_GPU_LABEL.fullmatch(label).group(1))),
            numa_node=int(numa) if numa is not None and numa.isdigit() else None,
            cpu_affinity=_affinity_value(matrix, affinity, "CPU_AFFINITY"),
        ))
        links.append(tuple(row_links[c] for c in gpu_columns))
    _check_symmetric(matrix, gpu_columns)
    nics = []
    for column in nic_columns:
        label = matrix.device_labels[column]
        row_links = matrix.rows[label][0]
        nics.append(Nic(name=matrix.nic_names.get(label, label), label=label,
                        gpu_links=tuple(row_links[c] for c in gpu_columns)))
    return GpuTopology(gpus=tuple(gpus), links=tuple(links), nics=tuple(nics))


def _check_symmetric(matrix: _Matrix, columns: list[int]) -> None:
    labels = matrix.device_labels
    for a in columns:
        for b in columns:
            ab, ba = matrix.rows[labels[a]][0][b], matrix.rows[labels[b]][0][a]
            if ab != ba:
                raise ValueError(f"nvidia-smi topo -m: {labels[a]}->{labels[b]} is {ab} but "
                                 f"{labels[b]}->{labels[a]} is {ba}; expected a symmetric matrix")


# ---------------------------------------------------------------------------------------------
# ibstat and /sys/class/infiniband

_CA_LINE = re.compile(r"CA\s+'([^']+)'")
_PORT_LINE = re.compile(r"Port\s+(\d+)\s*:")
_KEY_VALUE = re.compile(r"([A-Za-z][A-Za-z /_-]*?)\s*:\s*(.*)")
_RATE = re.compile(r"(\d+(?:\.\d+)?)")
_PORT_KEYS = {"state": "state", "physical state": "phys_state", "rate": "rate",
              "link layer": "link_layer"}


def _strip_code(value: str) -> str:
    """`"4: ACTIVE"` (sysfs) and `"Active"` (ibstat) both -> `"ACTIVE"`-style word."""
    return value.split(":", 1)[-1].strip()


def _parse_rate(value: str, where: str) -> float:
    match = _RATE.match(value.strip())
    if not match:
        raise ValueError(f"{where}: cannot read rate {value.strip()!r}: expected Gb/s such as "
                         "'400' or '400 Gb/sec (4X NDR)'")
    return float(match.group(1))


def _make_port(device: str, port: int, fields: dict[str, str], where: str) -> IBPort:
    missing = [key for key in ("state", "phys_state", "rate") if key not in fields]
    if missing:
        raise ValueError(f"{where}: port {port} of {device} lacks {missing}")
    return IBPort(
        device=device, port=port,
        state=_strip_code(fields["state"]).upper(),
        phys_state=_strip_code(fields["phys_state"]),
        rate_gbps=_parse_rate(fields["rate"], where),
        link_layer=fields.get("link_layer", "InfiniBand").strip() or "InfiniBand",
    )


@dataclass(frozen=True)
class IBStatReport:
    """The ports `ibstat` printed and the errors it printed among them, each naming a device."""

    ports: tuple[IBPort, ...]
    warnings: tuple[str, ...] = ()


def parse_ibstat(text: str) -> list[IBPort]:
    """The ports of `read_ibstat` (its warnings are logged)."""
    return list(read_ibstat(text).ports)


def read_ibstat(text: str) -> IBStatReport:
    """Parse `ibstat`: every port of every CA. The tool's own messages (`ibpanic:`, `ibwarn:`,
    `iberror:`) anywhere, and lines after the last port that are not `key: value`, become
    warnings; any other unreadable line before a later CA or port raises `ValueError`."""
    blocks: list[tuple[str, int, int, dict[str, str]]] = []  # device, port, line, fields
    device: Optional[str] = None
    in_port = False
    unread: list[tuple[int, str]] = []
    messages: list[tuple[int, str]] = []
    for number, line in _content_lines(text):
        stripped = line.strip()
        if _IB_TOOL_MESSAGE.match(stripped):
            messages.append((number, line))
            continue
        ca, port = _CA_LINE.fullmatch(stripped), _PORT_LINE.fullmatch(stripped)
        pair = _KEY_VALUE.fullmatch(stripped)
        if (ca or port) and unread:
            raise _line_error("ibstat", *unread[0], "CA '<name>', 'Port <n>:' or 'key: value'")
        if ca:
            device, in_port = ca.group(1), False
        elif port:
            if device is None:
                raise _line_error("ibstat", number, line, "a CA '<name>' line before its ports")
            blocks.append((device, int(port.group(1)), number, {}))
            in_port = True
        elif pair and in_port and pair.group(1).strip().lower() in _PORT_KEYS:
            blocks[-1][3][_PORT_KEYS[pair.group(1).strip().lower()]] = pair.group(2)
        elif stripped and not pair:
            unread.append((number, line))
    if device is None and unread:
        raise _line_error("ibstat", *unread[0], "CA '<name>' blocks")
    warnings = tuple(tool_warning("ibstat", number, line)
                     for number, line in sorted(messages + unread))
    for warning in warnings:
        logger.warning("%s", warning)
    ports = tuple(_make_port(device, port, fields, f"ibstat: line {number}")
                  for device, port, number, fields in blocks)
    return IBStatReport(ports, warnings)


def _natural_key(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _read_sysfs_value(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read().strip()
    except FileNotFoundError:
        return None


def parse_sysfs_infiniband(root_dir: str = "/sys/class/infiniband") -> list[IBPort]:
    """Read `<root>/<device>/ports/<n>/{state,phys_state,rate,link_layer}`; [] when root is absent.

    Raises `ValueError` naming the port directory when state, phys_state or rate is missing or
    unreadable (link_layer defaults to InfiniBand, as on kernels that lack the file)."""
    if not os.path.isdir(root_dir):
        return []
    ports = []
    for device in sorted(os.listdir(root_dir), key=_natural_key):
        ports_dir = os.path.join(root_dir, device, "ports")
        if not os.path.isdir(ports_dir):
            continue
        for port in sorted(os.listdir(ports_dir), key=_natural_key):
            port_dir = os.path.join(ports_dir, port)
            if not port.isdigit():
                raise ValueError(f"{port_dir}: expected a numbered port directory")
            fields = {key: value for key in ("state", "phys_state", "rate", "link_layer")
                      if (value := _read_sysfs_value(os.path.join(port_dir, key))) is not None}
            ports.append(_make_port(device, int(port), fields, port_dir))
    return ports
