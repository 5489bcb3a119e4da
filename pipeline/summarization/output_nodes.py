"""An output folder that every node of the cluster can write: the sink's write tasks run on
any node with a CPU, so on a multi-node cluster a folder only the driver's node sees would
scatter the parts over the nodes' own disks. Checked before the run starts."""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pipeline.errors import ConfigError

logger = logging.getLogger(__name__)


@ray.remote(num_cpus=0)
def _sees(marker: str) -> bool:
    return os.path.exists(marker)


def check_output_visible(folder: Path, timeout_s: float = 120.0) -> None:
    """Raise ConfigError, naming the nodes, when a node that may run a write task cannot see
    a file the driver just wrote into `folder`. One node: nothing to check."""
    nodes = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU")}
    if len(nodes) < 2:
        return
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / f".visible-{uuid.uuid4().hex}"
    marker.touch()
    try:
        blind = nodes_not_seeing(marker, list(nodes), timeout_s)
    finally:
        marker.unlink(missing_ok=True)
    if blind:
        where = ", ".join(sorted(nodes[node] for node in blind))
        raise ConfigError(
            f"output {folder} is not visible from {len(blind)} of the cluster's {len(nodes)} nodes ({where}); "
            "every node writes part files there: put it on a filesystem every node mounts at the same path"
        )
    logger.info("Output %s is visible from all %d nodes", folder, len(nodes))


def nodes_not_seeing(marker: Path, node_ids: list[str], timeout_s: float) -> list[str]:
    """The nodes among `node_ids` on which `marker` does not exist."""
    calls = {
        node: _sees.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(str(marker))
        for node in node_ids
    }
    return [node for node, call in calls.items() if not ray.get(call, timeout=timeout_s)]
