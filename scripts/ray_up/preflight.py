"""What the check needs from the machine before it creates anything, and the refusal that names
each missing piece with how to get it."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Callable, List, Optional

# (command, what provides it)
TOOLS = (
    ("ip", "iproute2 (apt-get install -y iproute2)"),
    ("unshare", "util-linux"),
    ("mount", "util-linux"),
    ("sshd", "openssh-server (apt-get update && apt-get install -y openssh-server)"),
    ("ssh", "openssh-client"),
    ("ssh-keygen", "openssh-client"),
    ("rsync", "rsync (apt-get install -y rsync): `ray up` copies file_mounts with it"),
)
SBIN = "/usr/local/sbin:/usr/sbin:/sbin"


@dataclass(frozen=True)
class Machine:
    """What preflight looks at; the defaults look at this machine."""

    euid: Callable[[], int] = os.geteuid
    which: Callable[[str], Optional[str]] = \
        lambda name: shutil.which(name, path=f"{os.environ.get('PATH', '')}:{SBIN}")
    host_python: str = "/usr/bin/python3"


def problems(machine: Machine = Machine()) -> List[str]:
    """Every reason the check cannot run here; empty when it can."""
    found = []
    if machine.euid() != 0:
        found.append(f"runs as uid {machine.euid()}: network, PID and mount namespaces need "
                     f"root (run it with sudo)")
    for name, package in TOOLS:
        if machine.which(name) is None:
            found.append(f"no `{name}` command: install {package}")
    if machine.which(machine.host_python) is None:
        found.append(f"no {machine.host_python}: the hosts' setup_commands create their venv "
                     f"with the system's python3 (apt-get install -y python3 python3-venv)")
    return found


def refusal(found: List[str]) -> str:
    lines = "\n".join(f"  - {item}" for item in found)
    return f"ray_up_check cannot run on this machine:\n{lines}"
