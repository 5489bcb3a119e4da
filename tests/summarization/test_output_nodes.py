"""The output folder is checked from every node that may write to it (a real local cluster:
one node sees what the driver wrote, and not what does not exist)."""

from __future__ import annotations

import pytest

from pipeline.summarization.output_nodes import check_output_visible, nodes_not_seeing

pytestmark = pytest.mark.ray


def test_a_node_that_cannot_see_the_folder_is_named(tmp_path):
    import ray

    ray.init(address="local", num_cpus=1, include_dashboard=False)
    try:
        node = ray.get_runtime_context().get_node_id()
        marker = tmp_path / "marker"
        marker.touch()
        assert nodes_not_seeing(marker, [node], 60) == []
        assert nodes_not_seeing(tmp_path / "absent", [node], 60) == [node]
        check_output_visible(tmp_path / "out")  # one node: it wrote the folder itself
    finally:
        ray.shutdown()
