"""The ledger: one small JSON file per cluster tplab started, so that what it leaves can be proved tplab's.

``$TPLAB_STATE_DIR`` (default ``<tmp>/tplab-<uid>``) holds ``clusters/<name>.json``:
{"profile_dir", "cluster_id", "owner_pid", "owner_started", "shm": [files its engines mapped]}. The cluster
writes it when it starts, its watchdog adds the shared-memory files, and whoever stops the cluster deletes
it after removing those files. ``tplab doctor`` reads what is left: a ledger whose cluster no longer runs
names files that are provably tplab's and orphaned.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile


def state_dir() -> str:
    default = os.path.join(tempfile.gettempdir(), f"tplab-{os.getuid() if hasattr(os, 'getuid') else 'user'}")
    return os.environ.get("TPLAB_STATE_DIR") or default


def path_of(profile_dir: str, cluster_id: str) -> str:
    digest = hashlib.sha1(f"{profile_dir}\0{cluster_id}".encode()).hexdigest()[:12]
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in cluster_id)[:40]
    return os.path.join(state_dir(), "clusters", f"{safe}-{digest}.json")


def read(profile_dir: str, cluster_id: str) -> dict | None:
    return _load(path_of(profile_dir, cluster_id))


def write(entry: dict) -> None:
    """Write (atomically) the entry of cluster (entry["profile_dir"], entry["cluster_id"])."""
    path = path_of(entry["profile_dir"], entry["cluster_id"])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(entry, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def add_shm(profile_dir: str, cluster_id: str, files) -> None:
    entry = read(profile_dir, cluster_id)
    if entry is not None and not set(files) <= set(entry.get("shm", [])):
        entry["shm"] = sorted(set(entry.get("shm", [])) | set(files))
        write(entry)


def remove(profile_dir: str, cluster_id: str) -> None:
    try:
        os.unlink(path_of(profile_dir, cluster_id))
    except FileNotFoundError:
        pass


def entries() -> list:
    """Every cluster entry in the ledger."""
    folder = os.path.join(state_dir(), "clusters")
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".json"))
    except OSError:
        return []
    return [e for e in (_load(os.path.join(folder, n)) for n in names) if e is not None]


def _load(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
