"""Several nodes on one Linux machine: network namespaces joined by a switch, for MPI's own launcher.

A network namespace is a copy of the kernel's network stack: its own interfaces, addresses, routes and
loopback. Processes in different namespaces cannot share a socket address or see each other's
interfaces, exactly as processes on different machines cannot. ``up`` makes:

    tplab-node0 .. tplab-node{N-1}   one namespace per node, each with loopback and one interface
                                     ``tplab0`` holding the node's address (10.213.0.1, .2, ... by default)
    tplab-switch                     a namespace holding a bridge (the cluster's switch), one port per node
    veth pairs                       a virtual cable from each node's tplab0 to its switch port

and shapes each node's tplab0 (shaping.py). The subnet exists only inside these namespaces: the
machine's own interfaces and routes are never touched. ``down`` deletes them all (deleting a namespace
deletes its interfaces). Both need root and iproute2's ``ip`` and ``tc``.

For MPI, ``up`` also writes into STATE_DIR (/run/tplab-nodes):

    hostfile      "tplab-node0:q" per node, as a cluster's hostfile lists its hosts
    launch.sh     the launcher hydra (MPICH's mpiexec) runs instead of ssh: it starts the command inside
                  the node's namespace, with the node's name as hostname
    layout.json   what was made, for ``status`` and ``mpiexec_command``

launcher.py builds the mpiexec (and ipcluster) command lines that use them.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

from tplab.nodes.shaping import Shaping

PREFIX = "tplab-node"
SWITCH = "tplab-switch"
BRIDGE = "tplab-br"
DEVICE = "tplab0"  # the node's interface: the same name in every node, so one FI_TCP_IFACE fits all
STATE_DIR = Path(os.environ.get("TPLAB_NODES_STATE", "/run/tplab-nodes"))


class NodesError(RuntimeError):
    """The machine cannot make namespaces (not root, no iproute2), or the nodes are not up."""


@dataclass
class Layout:
    """What ``up`` makes: ``nodes`` namespaces with ``ranks_per_node`` MPI slots each in the hostfile, their
    addresses in ``subnet`` (node k gets the (k+1)-th), each node's link shaped to ``rate`` (+ ``latency``)."""

    nodes: int = 2
    ranks_per_node: int = 2
    subnet: str = "10.213.0.0/24"
    rate: str | None = "10gbit"
    latency: str | None = None
    netem: bool = False           # whether this kernel had netem (the latency was really added)
    mpiexec: str = ""             # the launcher that goes with the hostfile (MPICH's hydra)
    state_dir: str = str(STATE_DIR)
    names: list = field(default_factory=list)

    def __post_init__(self):
        for name in ("nodes", "ranks_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        net = ipaddress.ip_network(self.subnet)
        if not net.is_private or net.num_addresses < self.nodes + 2:
            raise ValueError(f"subnet {self.subnet} must be a private range with room for {self.nodes} nodes")
        self.names = [f"{PREFIX}{k}" for k in range(self.nodes)]

    def address(self, node: int) -> str:
        return str(ipaddress.ip_network(self.subnet)[node + 1])

    @property
    def ranks(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def hostfile(self) -> Path:
        return Path(self.state_dir) / "hostfile"

    @property
    def launcher(self) -> Path:
        return Path(self.state_dir) / "launch.sh"

    def shaping(self) -> Shaping:
        return Shaping(rate=self.rate, latency=self.latency)

    def describe(self) -> str:
        nodes = ", ".join(f"{n} {self.address(k)}" for k, n in enumerate(self.names))
        return (f"{self.nodes} nodes x {self.ranks_per_node} ranks ({nodes}); "
                f"link: {self.shaping().describe(self.netem)}")


# ---- running ip and tc ------------------------------------------------------------------------------------
def check_can_run():
    """Raise NodesError with what is missing: root, and iproute2's ip and tc."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NodesError(f"tplab nodes needs iproute2 ({' and '.join(missing)} not found): "
                         "on Debian/Ubuntu `apt-get install iproute2`")
    if os.geteuid() != 0:
        raise NodesError("tplab nodes needs root: network namespaces and tc are root's (run it with sudo)")
    if shutil.which("unshare") is None:
        raise NodesError("tplab nodes needs unshare (util-linux) for each node's own hostname")


def namespaces_work() -> tuple[bool, str]:
    """Whether this machine lets us make network namespaces (root, iproute2, and a kernel and container
    that allow it), tried with a throwaway namespace; and why not."""
    try:
        check_can_run()
    except NodesError as e:
        return False, str(e)
    probe = f"{PREFIX}-probe-{os.getpid()}"  # (a name of its own: two processes may ask at once)
    proc = run("ip", "netns", "add", probe, check=False)
    run("ip", "netns", "del", probe, check=False)
    return (True, "") if proc.returncode == 0 else (False, f"`ip netns add` fails here: {proc.stderr.strip()}")


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise NodesError(f"`{' '.join(args)}` failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def in_node(name: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return run("ip", "netns", "exec", name, *args, check=check)


def existing() -> list[str]:
    """tplab's namespaces that exist now (nodes and switch)."""
    proc = run("ip", "netns", "list", check=False)
    names = [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]
    return sorted(n for n in names if n.startswith(PREFIX) or n == SWITCH)


def kernel_has_netem(probe_namespace: str) -> bool:
    """Try a netem qdisc on the namespace's loopback (then remove it): 'unknown qdisc' means no sch_netem."""
    proc = in_node(probe_namespace, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1us", check=False)
    if proc.returncode == 0:
        in_node(probe_namespace, "tc", "qdisc", "del", "dev", "lo", "root", check=False)
    return proc.returncode == 0


# ---- up, down, status ---------------------------------------------------------------------------------------
@contextmanager
def _one_at_a_time(wait: float = 120.0):
    """Hold the machine-wide lock of tplab's namespaces (an flock beside STATE_DIR, which ``down`` deletes):
    a second ``up`` or ``down`` started meanwhile (another terminal, another user) waits its turn instead of
    making and deleting the same namespaces at the same time -- which failed both. NodesError after ``wait``
    seconds, naming the process that holds it."""
    import fcntl  # (POSIX; namespaces are Linux's anyway)

    path = Path(f"{STATE_DIR}.lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as lock:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    lock.seek(0)
                    raise NodesError(f"another tplab nodes up/down (pid {lock.read().strip() or '?'}) has held "
                                     f"{path} for {wait:.0f} s") from None
                time.sleep(0.1)
        lock.seek(0)
        lock.truncate()
        lock.write(str(os.getpid()))
        lock.flush()
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def up(layout: Layout, mpiexec: str | None = None) -> Layout:
    """Make the nodes (tearing down any left over first). On a failure half way, tear down and raise. One
    ``up`` or ``down`` at a time on a machine: a second one waits (_one_at_a_time)."""
    check_can_run()
    with _one_at_a_time():
        _down()
        try:
            _make(layout)
            layout.mpiexec = mpiexec or _default_mpiexec()
            _write_state(layout)
        except BaseException:
            _down()
            raise
    return layout


def _make(layout: Layout):
    run("ip", "netns", "add", SWITCH)
    run("ip", "-n", SWITCH, "link", "set", "lo", "up")
    run("ip", "-n", SWITCH, "link", "add", BRIDGE, "type", "bridge")
    run("ip", "-n", SWITCH, "link", "set", BRIDGE, "up")
    prefix = ipaddress.ip_network(layout.subnet).prefixlen
    for k, name in enumerate(layout.names):
        port = f"tplab-s{k}"
        run("ip", "netns", "add", name)
        run("ip", "-n", name, "link", "set", "lo", "up")
        # both ends are made straight inside their namespaces: nothing appears in the machine's own
        run("ip", "link", "add", DEVICE, "netns", name, "type", "veth", "peer", "name", port, "netns", SWITCH)
        run("ip", "-n", name, "addr", "add", f"{layout.address(k)}/{prefix}", "dev", DEVICE)
        run("ip", "-n", name, "link", "set", DEVICE, "up")
        run("ip", "-n", SWITCH, "link", "set", port, "master", BRIDGE)
        run("ip", "-n", SWITCH, "link", "set", port, "up")
    layout.netem = kernel_has_netem(layout.names[0])
    for name in layout.names:
        for command in layout.shaping().commands(DEVICE, layout.netem):
            in_node(name, *command)


def _default_mpiexec() -> str:
    """The mpiexec beside this Python (the mpich wheel's hydra), else the first on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if not found:
        raise NodesError("no mpiexec: install the mpich wheel (pip install mpich) or an MPICH")
    return found


def _write_state(layout: Layout):
    state = Path(layout.state_dir)
    state.mkdir(parents=True, exist_ok=True)
    layout.hostfile.write_text("".join(f"{name}:{layout.ranks_per_node}\n" for name in layout.names))
    layout.launcher.write_text(resources.files("tplab.nodes").joinpath("launch.sh").read_text())
    layout.launcher.chmod(0o755)
    (state / "layout.json").write_text(json.dumps(asdict(layout), indent=1))


def down(quiet: bool = False) -> list[str]:
    """Delete every tplab namespace (their interfaces go with them) and the state files; returns the
    namespaces deleted. Safe to call when nothing is up."""
    if not quiet:
        check_can_run()
    with _one_at_a_time():
        return _down()


def _down() -> list[str]:
    removed = []
    for name in existing():
        stop_processes_in(name)
        if run("ip", "netns", "del", name, check=False).returncode == 0:
            removed.append(name)
    shutil.rmtree(STATE_DIR, ignore_errors=True)
    return removed


def stop_processes_in(name: str, grace: float = 3.0):
    """End what still runs inside a tplab namespace (an MPI job or an ipcluster left behind): a deleted
    namespace lives on while processes use it, with no way back in. SIGTERM, then SIGKILL after ``grace``."""
    pids = [int(p) for p in run("ip", "netns", "pids", name, check=False).stdout.split()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [p for p in pids if _signal(p, sig)]
        deadline = time.monotonic() + grace
        while alive and time.monotonic() < deadline:
            time.sleep(0.1)
            alive = [p for p in alive if _signal(p, 0)]
        if not alive:
            return
        pids = alive


def _signal(pid: int, sig) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def current() -> Layout:
    """The layout ``up`` made, or NodesError if the nodes are not up."""
    path = STATE_DIR / "layout.json"
    if not path.exists() or not any(n.startswith(PREFIX) for n in existing()):
        raise NodesError("no tplab nodes are up: `tplab nodes up --nodes 2 --ranks-per-node 2` first")
    data = json.loads(path.read_text())
    data.pop("names", None)
    return Layout(**data)


def status() -> str:
    try:
        layout = current()
    except NodesError as e:
        return str(e)
    lines = [layout.describe()]
    for name in layout.names:
        qdisc = in_node(name, "tc", "qdisc", "show", "dev", DEVICE, check=False).stdout.strip()
        lines.append(f"  {name}: {qdisc.splitlines()[0] if qdisc else '(no qdisc)'}")
    lines.append(f"hostfile {layout.hostfile}; launcher {layout.launcher}")
    return "\n".join(lines)
