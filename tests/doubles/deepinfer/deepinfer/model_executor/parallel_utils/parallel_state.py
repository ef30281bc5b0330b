"""TEST DOUBLE of ``deepinfer.model_executor.parallel_utils.parallel_state``: the process-wide ``PG`` groups.

DeepInfer builds device groups (NCCL/HCCL) and gloo mirrors of them; the double has one simulated world (one
process per DP rank, CP ranks imagined), so every group is that world and the DP group has ``dp`` ranks.
Imports ``torch.distributed`` (the torch test double in tests) only when the groups are created: with DP 1 the
double needs no torch, as DeepInfer's ``has_unfinished_requests`` communicates only when the group is larger.
"""

from __future__ import annotations

from typing import Any


class _SoloGroup:
    """The group of a process that never initialised torch.distributed (DP 1)."""

    def size(self) -> int:
        return 1


class ParallelProcessGroup:
    def __init__(self) -> None:
        self.dp_group: Any = _SoloGroup()
        self.cpu_dp_group: Any = _SoloGroup()
        self.world: Any = _SoloGroup()

    def create_process_groups(self, dp_size: int) -> None:
        import torch.distributed as dist

        ranks = list(range(dp_size))
        self.dp_group = self.cpu_dp_group = self.world = dist.new_group(ranks)

    def data_parallel_group(self) -> Any:
        return self.dp_group

    def cpu_data_parallel_group(self) -> Any:
        return self.cpu_dp_group

    def world_group(self) -> Any:
        return self.world


PG = ParallelProcessGroup()
