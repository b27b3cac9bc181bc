"""tplab.nodes: several nodes on one machine (network namespaces), and MPI across them.

The first tests need nothing: units, the tc commands, the mpiexec command line, the errors. The rest
bring up 2 nodes (root and iproute2 needed; they skip with the reason elsewhere), run the collectives'
MPI tests across them at 2x2 and 2x3 ranks with MPI's own launcher, and check that MPI finds 2 real
nodes, that the link is shaped, and that everything is torn down, also when bringing up fails half way.
Each MPI launch has a hard time limit and its whole process group is killed at the limit.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tplab import nodes
from tplab.cli import main as cli
from tplab.nodes import namespaces

ROOT = Path(__file__).resolve().parents[1]
CAN, WHY_NOT = nodes.namespaces_work()
needs_namespaces = pytest.mark.skipif(not CAN, reason=f"no network namespaces here: {WHY_NOT}")


# ---- without root ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, bits", [("10gbit", 1e10), ("500mbit", 5e8), ("1.5Gbit", 1.5e9), ("1gbps", 8e9)])
def test_parse_rate(text, bits):
    assert nodes.parse_rate(text) == pytest.approx(bits)


@pytest.mark.parametrize("text, seconds", [("20us", 2e-5), ("1ms", 1e-3), ("0", 0.0), ("2s", 2.0)])
def test_parse_time(text, seconds):
    assert nodes.parse_time(text) == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["fast", "10", "-1gbit", "0gbit", "10 furlongs"])
def test_bad_rate_says_how_to_write_one(bad):
    with pytest.raises(ValueError, match="10gbit"):
        nodes.Shaping(rate=bad)


def test_tc_commands_with_and_without_netem():
    shaping = nodes.Shaping(rate="10gbit", latency="20us")
    with_netem = shaping.commands("tplab0", with_netem=True)
    assert [c[5:9] for c in with_netem] == [["root", "handle", "1:", "netem"], ["parent", "1:1", "handle", "10:"]]
    assert "delay" in with_netem[0] and "20us" in with_netem[0] and "tbf" in with_netem[1]
    without = shaping.commands("tplab0", with_netem=False)
    assert len(without) == 1 and "tbf" in without[0] and "netem" not in without[0]
    assert "NOT added" in shaping.describe(with_netem=False) and "netem" in shaping.describe(with_netem=True)
    burst = int(without[0][without[0].index("burst") + 1])
    assert burst == 1_250_000  # 1 ms of 10 Gbit/s
    assert nodes.Shaping(rate=None).commands("tplab0", with_netem=False) == []


def test_layout_addresses_and_checks():
    layout = nodes.Layout(nodes=3, ranks_per_node=2, subnet="10.99.0.0/24")
    assert layout.names == ["tplab-node0", "tplab-node1", "tplab-node2"] and layout.ranks == 6
    assert [layout.address(k) for k in range(3)] == ["10.99.0.1", "10.99.0.2", "10.99.0.3"]
    with pytest.raises(ValueError, match="private"):
        nodes.Layout(subnet="8.8.8.0/24")
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="nodes"):
            nodes.Layout(nodes=bad)


def test_mpiexec_command_is_a_cluster_mpiexec():
    layout = nodes.Layout(nodes=2, ranks_per_node=3, mpiexec="/x/mpiexec", state_dir="/s")
    cmd = nodes.mpiexec_command(layout, ranks_per_node=2)
    assert cmd[:5] == ["ip", "netns", "exec", "tplab-node0", "/x/mpiexec"]
    def flag(name):
        return cmd[cmd.index(name) + 1]

    assert flag("-launcher-exec") == "/s/launch.sh" and flag("-f") == "/s/hostfile"
    assert flag("-localhost") == "10.213.0.1" and flag("-ppn") == "2" and flag("-n") == "4"
    assert "FI_TCP_IFACE" in cmd and nodes.DEVICE in cmd


def test_clear_errors_without_root_or_iproute2(monkeypatch):
    monkeypatch.setattr(namespaces.os, "geteuid", lambda: 1000)
    with pytest.raises(nodes.NodesError, match="root"):
        nodes.check_can_run()
    assert cli(["nodes", "up"]) == 1
    monkeypatch.setattr(namespaces.shutil, "which", lambda tool: None)
    with pytest.raises(nodes.NodesError, match="apt-get install iproute2"):
        nodes.check_can_run()
    assert nodes.namespaces_work()[0] is False


def test_launcher_refuses_other_hosts():
    script = Path(nodes.__file__).with_name("launch.sh")
    proc = subprocess.run(["sh", str(script), "-x", "elsewhere", "true"], capture_output=True, text=True, timeout=10)
    assert proc.returncode == 1 and "not a tplab node" in proc.stderr


def test_run_without_a_program(capsys):
    assert cli(["nodes", "run"]) == 2
    assert "give the program" in capsys.readouterr().err


# ---- with namespaces ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_nodes():
    layout = nodes.up(nodes.Layout(nodes=2, ranks_per_node=3, rate="10gbit", latency="20us"))
    try:
        yield layout
    finally:
        nodes.down()
        assert namespaces.existing() == [], "tplab namespaces left behind"


def mpi(layout, ranks_per_node, program, timeout=240, **env):
    """Run ``program`` on 2 nodes x ranks_per_node across the namespaces; the whole group dies at the limit."""
    try:
        return nodes.run_across(layout, program, ranks_per_node=ranks_per_node, timeout=timeout, capture=True, cwd=ROOT,
                                env=dict(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONFAULTHANDLER="1", **env))
    except TimeoutError as e:
        pytest.fail(str(e))


@needs_namespaces
def test_nodes_are_up_and_shaped(two_nodes):
    assert namespaces.existing() == ["tplab-node0", "tplab-node1", "tplab-switch"]
    assert two_nodes.hostfile.read_text() == "tplab-node0:3\ntplab-node1:3\n"
    for name in two_nodes.names:
        qdiscs = namespaces.in_node(name, "tc", "qdisc", "show", "dev", nodes.DEVICE).stdout
        assert "tbf" in qdiscs and "10Gbit" in qdiscs and ("netem" in qdiscs) == two_nodes.netem
    ping = namespaces.in_node("tplab-node0", sys.executable, "-c",
                              "import socket; s = socket.create_connection(('10.213.0.2', 9), 2)", check=False)
    assert "refused" in ping.stderr  # node 1 answers (nothing listens on port 9): the link is there
    assert "tplab-node1" in nodes.status()


@needs_namespaces
@pytest.mark.parametrize("ranks_per_node", [2, 3])
def test_collectives_across_two_nodes(two_nodes, ranks_per_node):
    """The collectives and the hierarchical all-reduce on real nodes: MPI finds 2 nodes (test_real_nodes_
    detected), inter-node messages go through TCP on the shaped link, intra-node ones through shared memory."""
    program = [sys.executable, "-m", "pytest", "tests/mpi/test_hierarchical.py", "tests/mpi/test_collectives.py",
               "-q", "-x", "-p", "no:cacheprovider", "-p", "no:nbmake"]
    rc, out = mpi(two_nodes, ranks_per_node, program, TPLAB_UNDER_MPIEXEC="1", TPLAB_HYPOTHESIS_EXAMPLES="5",
                  TPLAB_NODES_RANKS_PER_NODE=str(ranks_per_node))
    assert rc == 0, f"2 nodes x {ranks_per_node}: exit {rc}\n{out}"
    assert " passed" in out and "failed" not in out


def bytes_sent_by(name):
    stats = namespaces.in_node(name, "cat", f"/sys/class/net/{nodes.DEVICE}/statistics/tx_bytes").stdout
    return int(stats)


@needs_namespaces
@pytest.mark.parametrize("ranks_per_node, through_the_link", [(1, True), (2, False)])
def test_messages_between_nodes_take_the_link(two_nodes, ranks_per_node, through_the_link):
    """Rank 0 sends 8 MiB to rank 1: on another node they leave through node 0's interface (TCP on the
    shaped link); on the same node they do not (shared memory). Without MPI_ENV MPICH would take shared
    memory for both: every rank runs on one machine."""
    program = [sys.executable, "-c", "import numpy as np; from mpi4py import MPI; c = MPI.COMM_WORLD; "
               "x = np.ones(1 << 23, np.uint8); c.Send(x, 1) if c.rank == 0 else c.Recv(x, 0) if c.rank == 1 else None"]
    before = bytes_sent_by("tplab-node0")
    rc, out = mpi(two_nodes, ranks_per_node, program, timeout=60)
    assert rc == 0, out
    sent = bytes_sent_by("tplab-node0") - before
    assert (sent > 8 << 20) if through_the_link else (sent < 1 << 20), f"{sent} bytes left node 0"


@needs_namespaces
def test_each_node_has_its_own_hostname(two_nodes):
    program = [sys.executable, "-c", "import socket; from mpi4py import MPI; "
               "seen = MPI.COMM_WORLD.gather((socket.gethostname(), MPI.Get_processor_name())); "
               "MPI.COMM_WORLD.rank or print('seen', seen, flush=True)"]
    rc, out = mpi(two_nodes, 2, program, timeout=60)
    assert rc == 0, out
    names = [("tplab-node0",) * 2] * 2 + [("tplab-node1",) * 2] * 2
    assert f"seen {names}" in out, out


@needs_namespaces
def test_ipyparallel_cluster_across_the_nodes(two_nodes, tmp_path):
    """README's multi-node recipe, executed: the controller listens on node 0's address, mpiexec starts
    the engines on both nodes, a client on node 0 runs functions on them; MPI sees 2 nodes."""
    env = dict(os.environ, IPYTHONDIR=str(tmp_path / "ipython"), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    start = nodes.ipcluster_command(two_nodes, engines=4, cluster_id="multi", ranks_per_node=2)
    assert "--ip=10.213.0.1" in start
    ipcluster = start[start.index("start") - 1]
    try:
        proc = subprocess.run(start, env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr[-2000:]
        client = ("import tplab.cluster as c\n"
                  "def where():\n    import socket\n    from tplab.comm import world\n"
                  "    return socket.gethostname(), world().node_ids()\n"
                  "cluster = c.connect('multi', n=4, timeout=60)\nprint('seen', cluster.run(where))\n")
        proc = subprocess.run(nodes.in_login_node(two_nodes) + [sys.executable, "-c", client], env=env,
                              capture_output=True, text=True, timeout=90)
        assert proc.returncode == 0, proc.stderr[-2000:]
        layout = [0, 0, 1, 1]
        expected = [("tplab-node0", layout)] * 2 + [("tplab-node1", layout)] * 2
        assert f"seen {expected}" in proc.stdout, proc.stdout
    finally:
        subprocess.run(nodes.in_login_node(two_nodes) + [ipcluster, "stop", "--cluster-id=multi"], env=env,
                       capture_output=True, timeout=60)


@needs_namespaces
def test_three_nodes_through_the_bridge():
    """More than two nodes meet at the switch's bridge; 5 ranks on nodes of 2 fill them 2, 2, 1.
    (After the tests above: bringing these up removes the module's 2 nodes.)"""
    layout = nodes.up(nodes.Layout(nodes=3, ranks_per_node=2, rate="10gbit"))
    try:
        program = [sys.executable, "-c", "import socket; from mpi4py import MPI; from tplab.comm import world; "
                   "seen = MPI.COMM_WORLD.gather(socket.gethostname()); ids = world().node_ids(); "
                   "MPI.COMM_WORLD.rank or print('seen', seen, ids, flush=True)"]
        rc, out = nodes.run_across(layout, program, ranks=5, timeout=60, capture=True, cwd=ROOT,
                                   env={"PYTHONPATH": str(ROOT)})
        assert rc == 0, out
        names = ["tplab-node0"] * 2 + ["tplab-node1"] * 2 + ["tplab-node2"]
        assert f"seen {names} [0, 0, 1, 1, 2]" in out, out
    finally:
        nodes.down()


@needs_namespaces
def test_the_command(capsys):
    """tplab nodes up | status | run | login | down, as a user types them."""
    try:
        assert cli(["nodes", "up", "--nodes", "2", "--ranks-per-node", "1", "--rate", "1gbit", "--latency", "20us"]) == 0
        said = capsys.readouterr().out
        assert "10.213.0.2" in said and "1gbit" in said and ("netem" in said)
        assert cli(["nodes", "status"]) == 0 and "tbf" in capsys.readouterr().out
        assert cli(["nodes", "run", "--", sys.executable, "-c", "from mpi4py import MPI; assert MPI.COMM_WORLD.size == 2"]) == 0
        assert cli(["nodes", "login", "--", "ip", "-br", "addr", "show", nodes.DEVICE]) == 0
    finally:
        assert cli(["nodes", "down"]) == 0
    assert "removed tplab-node0, tplab-node1, tplab-switch" in capsys.readouterr().out
    assert cli(["nodes", "run", "--", "true"]) == 1 and "no tplab nodes are up" in capsys.readouterr().err


@needs_namespaces
def test_a_failure_half_way_up_leaves_nothing(monkeypatch):
    """up() tears down what it made when a step fails."""
    def broken_tc(name, *args, check=True):
        raise nodes.NodesError("tc broke")

    monkeypatch.setattr(namespaces, "in_node", broken_tc)
    monkeypatch.setattr(namespaces, "kernel_has_netem", lambda name: False)
    with pytest.raises(nodes.NodesError, match="tc broke"):
        nodes.up(nodes.Layout(nodes=2))
    assert namespaces.existing() == [] and not namespaces.STATE_DIR.exists()


@needs_namespaces
def test_two_ups_at_once_take_turns():
    """Two `tplab nodes up` started together (two users, two terminals) take turns: both succeed, one after
    the other, and what is up afterwards is one whole layout, not a mix of the two."""
    command = [sys.executable, "-m", "tplab", "nodes", "up", "--nodes", "{n}", "--ranks-per-node", "1"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    try:
        runs = [subprocess.Popen([a.format(n=n) for a in command], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True) for n in (2, 3)]
        outputs = [run.communicate(timeout=120)[0] for run in runs]
        assert [run.returncode for run in runs] == [0, 0], outputs
        layout = nodes.current()
        assert namespaces.existing() == sorted(layout.names + [namespaces.SWITCH])
        assert layout.hostfile.read_text().count("tplab-node") == layout.nodes
    finally:
        nodes.down()
    assert namespaces.existing() == []
