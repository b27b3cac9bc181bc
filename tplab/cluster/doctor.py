"""``tplab doctor``: the clusters, engines and shared-memory files on this machine, whose they are, and
whether their owner lives; ``--clean`` removes only what is provably tplab's and orphaned.

Provably tplab's: a cluster whose processes carry ``TPLAB_OWNER_PID`` (ownership.py) -- orphaned when that
process is dead -- and a /dev/shm file that a tplab cluster's ledger lists (ledger.py) -- orphaned when no
process maps it and its cluster no longer runs. Clusters started by hand (ipcluster) are listed, never
stopped; MPICH files that nothing maps but no ledger names (another program's, or from before tplab kept a
ledger) are listed as "unknown", never removed.

    report = examine()          # {"clusters": [...], "shm": [...]}
    print(format_report(report))
    clean(report)               # the lines saying what it removed
"""

from __future__ import annotations

import os

import psutil

from tplab.cluster import ledger, shm
from tplab.cluster.ownership import owner_of
from tplab.cluster.processes import cmdline, is_engine, shutdown


def _ipp_processes() -> dict:
    """{(profile_dir, cluster_id): [processes]} for every ipyparallel cluster this user can see."""
    found = {}
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
            if proc.status() == psutil.STATUS_ZOMBIE or proc.pid == os.getpid():
                continue
        except (psutil.Error, OSError):
            continue
        if "IPP_CLUSTER_ID" in env and "IPP_PROFILE_DIR" in env:
            found.setdefault((env["IPP_PROFILE_DIR"], env["IPP_CLUSTER_ID"]), []).append(proc)
    return found


def examine() -> dict:
    clusters = []
    for (profile_dir, cluster_id), procs in sorted(_ipp_processes().items()):
        owner = owner_of(procs)
        engines = [p.pid for p in procs if is_engine(p)]
        clusters.append({
            "cluster_id": cluster_id, "profile_dir": profile_dir, "owner": owner, "engines": engines,
            "controller": any("ipyparallel.controller" in cmdline(p) for p in procs),
            "watchdog": any("tplab.cluster.watchdog" in cmdline(p) for p in procs),
            "pids": [p.pid for p in procs], "orphan": owner.pid is not None and not owner.alive,
            "shm": shm.mapped_files(engines)})
    running = {(c["profile_dir"], c["cluster_id"]) for c in clusters}
    in_ledgers = {}
    for entry in ledger.entries():
        for path in entry.get("shm", []):
            in_ledgers[path] = entry
    paths = set(in_ledgers) | set(shm.orphan_candidates()) | {p for c in clusters for p in c["shm"]}
    files = []
    for path, pids in sorted(shm.users(p for p in paths if os.path.exists(p)).items()):
        holder = next((c["cluster_id"] for c in clusters if path in c["shm"]), None)
        entry = in_ledgers.get(path)
        ours = holder is not None or entry is not None
        cluster_runs = entry is not None and (entry["profile_dir"], entry["cluster_id"]) in running
        files.append({"path": path, "size": _size(path), "pids": pids, "cluster_id": holder or (entry or {}).get(
            "cluster_id"), "tplab": ours, "orphan": ours and not pids and not cluster_runs})
    stale = [e for e in ledger.entries() if (e["profile_dir"], e["cluster_id"]) not in running]
    return {"clusters": clusters, "shm": files, "stale_ledgers": stale}


def format_report(report) -> str:
    lines = [f"clusters ({len(report['clusters'])}):"]
    for c in report["clusters"]:
        state = "ORPHAN (owner dead)" if c["orphan"] else "ok"
        lines.append(f"  {c['cluster_id']:<24} {len(c['engines'])} engines, controller "
                     f"{'up' if c['controller'] else 'DOWN'}, watchdog {'yes' if c['watchdog'] else 'no'}; "
                     f"owner: {c['owner'].describe()}; {state}")
        lines.append(f"  {'':<24} {c['profile_dir']}; pids {' '.join(map(str, c['pids']))}")
    lines.append(f"shared-memory files ({len(report['shm'])}):")
    for f in report["shm"]:
        whose = f"tplab cluster {f['cluster_id']!r}" if f["tplab"] else "unknown (not provably tplab's)"
        users = f"mapped by {' '.join(map(str, f['pids']))}" if f["pids"] else "mapped by nobody"
        lines.append(f"  {f['path']:<34} {f['size'] / 2**20:5.1f} MiB  {whose}; {users}"
                     + ("; ORPHAN" if f["orphan"] else ""))
    orphans = sum(c["orphan"] for c in report["clusters"]) + sum(f["orphan"] for f in report["shm"])
    lines.append(f"{orphans} orphaned: `tplab doctor --clean` removes them" if orphans else "nothing orphaned")
    return "\n".join(lines)


def clean(report) -> list:
    """Stop orphaned tplab clusters, remove orphaned tplab shm files and stale ledger entries."""
    done = []
    for c in report["clusters"]:
        if c["orphan"]:
            shutdown(None, c["profile_dir"], c["cluster_id"], kill_engines_first=True)
            done.append(f"stopped cluster {c['cluster_id']!r} (owner {c['owner'].pid} is dead): "
                        f"{len(c['pids'])} processes")
    for path in shm.remove_unused(f["path"] for f in report["shm"] if f["orphan"]):
        done.append(f"removed {path}")
    for entry in report["stale_ledgers"]:
        ledger.remove(entry["profile_dir"], entry["cluster_id"])
    return done


def _size(path) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0
