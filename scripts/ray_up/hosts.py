"""Hosts for `ray up` on one machine: each a network namespace on a bridge, with its own PID,
mount and UTS namespaces and an `sshd` as the PID namespace's first process.

What each host owns (so `ray stop`, `~` and `/tmp` behave as on a separate machine):
  - a network namespace with `eth0` at its address on a /24 that a bridge in the root namespace
    joins (the bridge holds `.1`, so the machine running `ray up` reaches every host); no default
    route: the hosts reach each other and that bridge address, nothing else;
  - a PID namespace (`ray stop` there sees only that host's processes) whose first process is
    `sshd`; `unshare --kill-child` ties it to the `unshare` process, so killing that one ends
    every process of the host;
  - a mount namespace with its own `/root` (the ssh user's home), `/tmp`, `/run`, `/mnt` and
    `/etc/hosts` (its host name resolves to its own address: Ray and gloo find it from there),
    each a directory under the host's folder; the checkpoint is bind-mounted read-only at the
    same path on every host;
  - a UTS namespace with its own host name.
Everything else of the file system (/usr, the Python, /var/tmp) is the machine's.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

SSHD = "/usr/sbin/sshd"
MODELS_MOUNT = "/mnt/models"


@dataclass(frozen=True)
class Host:
    """One host: its names, its address, and the folder that holds its private directories."""

    name: str        # host name, e.g. tpsr-1234-head
    netns: str       # network namespace name
    veth: str        # the root namespace's end of its link (on the bridge)
    address: str     # eth0's address inside the namespace
    root: Path       # home/, tmp/, run/, mnt/, hosts, sshd_config, ssh_host_ed25519_key

    @property
    def home(self) -> Path:
        return self.root / "home"


@dataclass(frozen=True)
class Network:
    bridge: str
    gateway: str     # the bridge's address: where the machine running `ray up` sits
    prefix: int
    hosts: Sequence[Host]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def free_subnet(tag: int, routes: str) -> str:
    """The first 10.77.N.0/24, N from `tag`, that no route of the root namespace mentions."""
    for step in range(250):
        third = (tag + step) % 250 + 1
        if f"10.77.{third}." not in routes:
            return f"10.77.{third}"
    raise RuntimeError("every 10.77.N.0/24 is routed here already; remove some of those links")


def plan_network(tag: int, roles: Sequence[str], workdir: Path, routes: str) -> Network:
    """Names and addresses for hosts `roles` (e.g. head, worker); `tag` keeps them unique."""
    subnet = free_subnet(tag, routes)
    hosts = [Host(name=f"tpsr-{tag}-{role}", netns=f"tpsr-{tag}-{role}",
                  veth=f"tpsr{tag}{role[0]}{i}", address=f"{subnet}.{10 + i}",
                  root=workdir / "hosts" / role) for i, role in enumerate(roles)]
    return Network(bridge=f"tpsrb{tag}", gateway=f"{subnet}.1", prefix=24, hosts=hosts)


def create_network(network: Network) -> None:
    """The bridge (with the gateway address) and one namespace per host, linked to it."""
    _ip("link", "add", network.bridge, "type", "bridge")
    _ip("addr", "add", f"{network.gateway}/{network.prefix}", "dev", network.bridge)
    _ip("link", "set", network.bridge, "up")
    for host in network.hosts:
        _ip("netns", "add", host.netns)
        _ip("-n", host.netns, "link", "set", "lo", "up")
        _ip("link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns",
            host.netns)
        _ip("link", "set", host.veth, "master", network.bridge)
        _ip("link", "set", host.veth, "up")
        _ip("-n", host.netns, "addr", "add", f"{host.address}/{network.prefix}", "dev", "eth0")
        _ip("-n", host.netns, "link", "set", "eth0", "up")


def prepare_host(host: Host, network: Network, authorized_key: str, pip_conf: str) -> None:
    """The host's folder: a home with the client's public key, /etc/skel's shell files and a pip
    configuration, empty /tmp, /run and /mnt (with /mnt/nvme, the disk tier's drive), its
    /etc/hosts, an sshd configuration and host key."""
    for sub in ("home/.ssh", "home/.config/pip", "tmp", "run", "mnt/nvme", "mnt/models"):
        (host.root / sub).mkdir(parents=True, exist_ok=True)
    os.chmod(host.root / "tmp", 0o1777)
    os.chmod(host.home, 0o700)
    os.chmod(host.home / ".ssh", 0o700)
    for skel in Path("/etc/skel").glob(".*"):
        if skel.is_file():
            shutil.copy(skel, host.home / skel.name)
    (host.home / ".ssh" / "authorized_keys").write_text(authorized_key)
    (host.home / ".config" / "pip" / "pip.conf").write_text(pip_conf)
    names = "\n".join(f"{other.address} {other.name}" for other in network.hosts)
    (host.root / "hosts").write_text(f"127.0.0.1 localhost\n{names}\n")
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f",
                    str(host.root / "ssh_host_ed25519_key")], check=True, timeout=30)
    (host.root / "sshd_config").write_text(sshd_config(host))


def sshd_config(host: Host) -> str:
    return "\n".join([
        f"ListenAddress {host.address}", "Port 22",
        f"HostKey {host.root / 'ssh_host_ed25519_key'}",
        "PermitRootLogin prohibit-password", "PasswordAuthentication no",
        "KbdInteractiveAuthentication no", "UsePAM no", "PidFile none",
        "AuthorizedKeysFile .ssh/authorized_keys", "Subsystem sftp internal-sftp", ""])


def boot_script(host: Host, model_dir: Optional[Path]) -> str:
    """What the host's first process runs: its mounts and host name, then sshd in the
    foreground. Mount order matters: the model's source lies under the machine's /root, so it
    is bound before /root is covered."""
    lines = ["set -e", f"mount --bind {host.root / 'mnt'} /mnt"]
    if model_dir is not None:
        target = f"{MODELS_MOUNT}/{model_dir.name}"
        lines += [f"mkdir -p {target}", f"mount --bind {model_dir} {target}",
                  f"mount -o remount,bind,ro {target}"]
    lines += [f"mount --bind {host.home} /root", f"mount --bind {host.root / 'tmp'} /tmp",
              f"mount --bind {host.root / 'run'} /run", "mkdir -p /run/sshd",
              f"mount --bind {host.root / 'hosts'} /etc/hosts", f"hostname {host.name}",
              f"exec {SSHD} -D -e -f {host.root / 'sshd_config'}"]
    return "\n".join(lines)


def start_host(host: Host, model_dir: Optional[Path], log: Path) -> subprocess.Popen:
    """The host's `unshare` process (its PID namespace's first process is sshd)."""
    argv = ["ip", "netns", "exec", host.netns, "unshare", "--pid", "--fork", "--kill-child",
            "--mount-proc", "--mount", "--uts", "--propagation", "private",
            "bash", "-c", boot_script(host, model_dir)]
    with open(log, "ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def wait_sshd(host: Host, process: subprocess.Popen, timeout_s: float = 20.0) -> None:
    """Until the host's sshd accepts connections on port 22, or its process has exited."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"host {host.name}: its sshd exited with {process.returncode} "
                               f"(see {host.root.parent.parent / 'logs'})")
        probe = subprocess.run(["ip", "netns", "exec", host.netns, "bash", "-c",
                                f"exec 3<>/dev/tcp/{host.address}/22"], capture_output=True,
                               timeout=10)
        if probe.returncode == 0:
            return
        time.sleep(0.2)
    raise RuntimeError(f"host {host.name}: sshd not listening on {host.address}:22 after "
                       f"{timeout_s:.0f} s")


def stop_hosts(processes: Dict[str, subprocess.Popen], network: Network) -> List[str]:
    """Ends every process of every host (SIGKILL to each host's `unshare`, whose PID namespace
    dies with it, then any process still in a network namespace), removes the namespaces,
    links and bridge. Returns what could not be removed; never raises."""
    problems = []
    for process in processes.values():
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            problems.append(f"process {process.pid} did not exit")
    for host in network.hosts:
        for pid in _ip("netns", "pids", host.netns, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        for args in (["link", "del", host.veth], ["netns", "del", host.netns]):
            _remove(args, problems)
    _remove(["link", "del", network.bridge], problems)
    return problems


def _remove(args: List[str], problems: List[str]) -> None:
    done = _ip(*args, check=False)
    if done.returncode != 0 and "Cannot find" not in done.stderr \
            and "No such file" not in done.stderr:
        problems.append(f"ip {' '.join(args)}: {done.stderr.strip()}")
