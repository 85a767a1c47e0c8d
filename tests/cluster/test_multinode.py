"""Replicas on a Ray cluster of two nodes: `ray.cluster_utils` runs a head and a worker raylet on
this machine, which is how Ray itself tests multi-node placement without a second machine.

`ClusterEngine.launch(..., ray_address=...)` is the `driftgate serve --replicas N --ray-address
ADDR` path: it joins the running cluster instead of starting one, and SPREAD places one replica
on each node.
"""

from __future__ import annotations

import pytest
import torch

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from engine.cluster.cluster_engine import ClusterEngine  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from tests.cluster.test_replicas import run  # noqa: E402


def _node_of(actor) -> str:
    return ray.get(actor.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id()))


def test_replicas_spread_over_the_nodes_of_a_joined_cluster(tiny_model_dir):
    assert not ray.is_initialized()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=4)  # logical CPUs: room for both replicas on either node, so only SPREAD splits them
        cluster.wait_for_nodes()
        # `serve --no-prefix-caching`: the router must not count prompt blocks as cached either
        config = EngineConfig(str(tiny_model_dir), block_size=4, num_kv_blocks=64, max_num_seqs=4,
                              enable_prefix_caching=False)
        engine = ClusterEngine.launch(config, 2, "round-robin", ray_address=cluster.address)
        assert not engine.router.config.prefix_caching
        alive = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
        assert len(alive) == 2 and {_node_of(actor) for actor in engine.actors} == alive  # one replica a node
        prompts = [[(5 * i + j) % 300 + 3 for j in range(8 + i)] for i in range(4)]
        outs = run(engine, prompts)
        assert all(o.finished and len(o.outputs[0].token_ids) == 4 for o in outs)
        assert engine.num_dispatched == [2, 2]  # both nodes served
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_cuda_replicas_ask_for_a_gpu_each_and_a_shortage_is_refused_up_front():
    from engine.cluster.replica import gpus_per_replica

    assert gpus_per_replica("cpu", 4, cluster_gpus=8) == 0
    assert gpus_per_replica("cuda", 2, cluster_gpus=2) == gpus_per_replica("cuda:1", 1, cluster_gpus=8) == 1
    with pytest.raises(ValueError, match="3 replicas on cuda need 3 GPUs, one each; the Ray cluster has 2"):
        gpus_per_replica("cuda", 3, cluster_gpus=2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine whose Ray has no GPU")
def test_launching_cuda_replicas_without_gpus_fails_before_any_starts(tiny_model_dir):
    """None would ever be placed: refused at once, and the Ray instance it started is stopped."""
    assert not ray.is_initialized()
    config = EngineConfig(str(tiny_model_dir), device="cuda")
    with pytest.raises(ValueError, match="the Ray cluster has 0"):
        ClusterEngine.launch(config, 2)
    assert not ray.is_initialized()
