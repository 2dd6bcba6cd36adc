"""Parallelism passed into the model: which rank this process is, and the group to reduce over.

Layout (the shard plan in convert/shard.py decides which tensors each rank loads):
* tensor parallel over ``tp`` ranks: attention heads split by rank (kv heads replicated when
  tp > kv heads), o_proj split by input columns, so its output is a partial sum;
* experts: ``ep`` expert groups of ``tp // ep`` ranks each; rank r holds the experts of group
  ``r // (tp // ep)`` and, within them, part ``r % (tp // ep)`` of the intermediate dimension.
  Every rank's down projection is a partial sum over (expert, intermediate part).
The model all-reduces exactly where OpenAI's reference does: after o_proj and after the MoE down
projection (biases added once, by their owner rank, before the sum).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Parallel:
    rank: int = 0
    world: int = 1
    tp: int = 1
    ep: int = 1
    group: Any = None  # a torch.distributed process group; None = the default group

    def __post_init__(self) -> None:
        assert self.world == self.tp, f"world {self.world} must equal tp {self.tp}"
        assert 0 <= self.rank < self.world, f"rank {self.rank} outside world {self.world}"
        assert self.tp % self.ep == 0, f"tp {self.tp} not a multiple of ep {self.ep}"

    @property
    def parts(self) -> int:
        """Ranks per expert group (intermediate-dimension parts of each expert)."""
        return self.tp // self.ep

    @property
    def expert_group(self) -> int:
        return self.rank // self.parts

    @property
    def expert_part(self) -> int:
        return self.rank % self.parts

    @property
    def owns_row_bias(self) -> bool:
        """Whether this rank adds the bias of a row-parallel (partial-sum) linear such as o_proj."""
        return self.rank == 0

    @property
    def owns_expert_bias(self) -> bool:
        """Whether this rank adds down_proj_bias for its experts (part 0 of its expert group)."""
        return self.expert_part == 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in float32 (gloo has no bf16, and fp32 sums keep partials exact
        enough); returns a tensor of t's dtype. Identity when world == 1."""
        if self.world == 1:
            return t
        buf = t.float().contiguous()
        if buf.is_cuda and dist.get_backend(self.group) == "gloo":
            # Several ranks sharing one GPU (NCCL refuses that): reduce through host memory.
            host = buf.cpu()
            dist.all_reduce(host, op=dist.ReduceOp.SUM, group=self.group)
            return host.to(device=t.device, dtype=t.dtype)
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group)
        return buf.to(t.dtype)


SINGLE = Parallel()
