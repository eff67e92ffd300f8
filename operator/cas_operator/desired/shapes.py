"""Instance shapes: how many GPUs, nodes and pods one prefill or decode instance takes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class InstanceShape:
    """One engine instance: `tensor_parallel` GPUs spread over `nodes` pods of `gpus_per_pod`."""

    tensor_parallel: int
    context_parallel: int
    nodes: int
    gpus_per_pod: int

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_pod

    @property
    def multi_node(self) -> bool:
        return self.nodes > 1


def instance_shape(
    *, tensor_parallel: int, gpus_per_node: int, context_parallel: int = 1
) -> InstanceShape:
    """GPUs per instance = tp; an instance wider than a node spans tp / gpusPerNode nodes.

    Raises ValueError when tp does not fit whole nodes (validation reports it by field first).
    """
    if tensor_parallel <= gpus_per_node:
        return InstanceShape(tensor_parallel, context_parallel, 1, tensor_parallel)
    if tensor_parallel % gpus_per_node:
        raise ValueError(
            f"tensorParallel {tensor_parallel} is not a multiple of gpusPerNode {gpus_per_node}"
        )
    return InstanceShape(
        tensor_parallel, context_parallel, tensor_parallel // gpus_per_node, gpus_per_node
    )
