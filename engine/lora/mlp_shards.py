"""An attention-DP member's part of each LoRA adapter (a `LoRAShards`): attention runs on the
member's own rows, so q/k/v/o adapters stay whole; the dense MLP is split over the group by its
intermediate dim, so the member keeps the rows of gate/up's B and the columns of down's A that
its slice [lo, hi) computes (the members' partial down updates add up in the MLP's reduction)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.lora.adapter import LoRAModule, target_shapes

if TYPE_CHECKING:
    from engine.config import ModelConfig


class MLPSliceShards:
    def __init__(self, cfg: ModelConfig, lo: int, hi: int) -> None:
        if not 0 <= lo < hi <= cfg.intermediate_size:
            raise ValueError(f"[{lo}, {hi}) is not a slice of intermediate_size {cfg.intermediate_size}")
        self.cfg, self.lo, self.hi = cfg, lo, hi

    def target_shapes(self) -> dict[str, tuple[int, int]]:
        shapes = target_shapes(self.cfg)
        h, part = self.cfg.hidden_size, self.hi - self.lo
        return shapes | {"gate_proj": (h, part), "up_proj": (h, part), "down_proj": (part, h)}

    def shard(self, layer: int, target: str, module: LoRAModule) -> LoRAModule:
        """This member's A and B of `target` (copies where sliced: the whole adapter can be freed)."""
        if target in ("gate_proj", "up_proj"):
            return LoRAModule(module.lora_a, module.lora_b[self.lo:self.hi].clone(), module.scaling)
        if target == "down_proj":
            return LoRAModule(module.lora_a[:, self.lo:self.hi].clone(), module.lora_b, module.scaling)
        return module
