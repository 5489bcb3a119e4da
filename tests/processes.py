"""Processes of one job: what a test kills must be its own job's, not another test's running
beside it (the suite runs in two workers)."""

from __future__ import annotations

import psutil


def descendants(root: int, *fragments: str) -> list[int]:
    """Pids, ascending, of `root`'s descendants whose command line holds every fragment (a Ray
    worker's is its title, "ray::EngineReplica..."): a job's Ray cluster is started by the job's
    own process, so its workers descend from it."""
    found = []
    try:
        children = psutil.Process(root).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    for child in children:
        try:
            line = " ".join(child.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if all(fragment in line for fragment in fragments):
            found.append(child.pid)
    return sorted(found)
