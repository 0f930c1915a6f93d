"""The device pool of LoRA slots and the per-step LoRA delta on top of the base linears.

Owns: for every layer and projection group of the model (`qkv`, `o`, `gate_up`, `down`: the
model's fused linears), stacked weights `A [max_loras, R_g, in]` and `B [max_loras, out, R_g]`
allocated once (a group of k modules has `R_g = k x max_rank`: each module's A rows and B
block-diagonal columns sit in their own `max_rank` band, zero-padded), which adapters are in
which slot, and the step's row → slot grouping (`LoraBatch`).

The delta is computed per slot group, shrink then expand (punica's SGMV, Chen et al.,
arXiv:2310.18547; vLLM's `punica_cpu` does the same in torch): for the rows of slot s,
`out[rows] += (x[rows] @ A[s].T) @ B[s].T`. Rows of the base model are in no group and pay
nothing; a group whose adapter has no weight for a module is skipped.

In: `LoraAdapter`s (engine.lora.adapter) to load into slots; the runner's `LoraBatch` per step.
Out: the base linear's output with the deltas added (in place).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.lora.adapter import LoraAdapter, module_shapes

GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
          "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}


@dataclass
class LoraBatch:
    """The step's rows per slot: `groups` of (slot, rows), rows a slice of the flat token
    batch or an int64 index tensor."""

    groups: list[tuple[int, slice | torch.Tensor]] = field(default_factory=list)


class LoraSlots:
    """`max_loras` device slots for adapters of rank ≤ `max_rank` on a model of `cfg`, in
    `dtype` on `device` (see the module docstring)."""

    def __init__(self, cfg, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        shapes = module_shapes(cfg)
        self.a: list[dict[str, torch.Tensor]] = []
        self.b: list[dict[str, torch.Tensor]] = []
        self.offsets: dict[str, int] = {}          # module -> first output column in its group
        for _ in range(cfg.num_layers):
            a, b = {}, {}
            for group, modules in GROUPS.items():
                n_in = shapes[modules[0]][0]
                n_out = sum(shapes[m][1] for m in modules)
                a[group] = torch.zeros(max_loras, len(modules) * max_rank, n_in, dtype=dtype,
                                       device=device)
                b[group] = torch.zeros(max_loras, n_out, len(modules) * max_rank, dtype=dtype,
                                       device=device)
            self.a.append(a)
            self.b.append(b)
        for modules in GROUPS.values():
            col = 0
            for m in modules:
                self.offsets[m] = col
                col += shapes[m][1]
        self.present: list[set[tuple[int, str]]] = [set() for _ in range(max_loras)]
        self.batch: LoraBatch | None = None

    @property
    def nbytes(self) -> int:
        """Device memory of the pool (bytes)."""
        return sum(t.nbytes for d in self.a + self.b for t in d.values())

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy `adapter` into `slot` (whatever was there is cleared)."""
        r = self.max_rank
        for a, b in zip(self.a, self.b):
            for group in GROUPS:
                a[group][slot].zero_()
                b[group][slot].zero_()
        present = set()
        for (layer, module), (a_w, b_w) in adapter.weights.items():
            group = next(g for g, ms in GROUPS.items() if module in ms)
            band = GROUPS[group].index(module) * r
            rank = a_w.shape[0]
            col = self.offsets[module]
            self.a[layer][group][slot, band:band + rank] = a_w
            self.b[layer][group][slot, col:col + b_w.shape[0], band:band + rank] = b_w
            present.add((layer, group))
        self.present[slot] = present

    def apply(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (`[T, out]`, the base linear's result for `x [T, in]`) plus each row's
        adapter delta for this layer's `group`, in place."""
        batch = self.batch
        if batch is None:
            return out
        a, b = self.a[layer][group], self.b[layer][group]
        for slot, rows in batch.groups:
            if (layer, group) not in self.present[slot]:
                continue
            delta = (x[rows].to(a.dtype) @ a[slot].T) @ b[slot].T
            if isinstance(rows, slice):
                out[rows] += delta.to(out.dtype)
            else:
                out.index_add_(0, rows, delta.to(out.dtype))
        return out


class LoraLinear:
    """A base `engine.linear.Linear` of one layer and group, followed by the LoRA deltas of
    the step's adapters (`LoraSlots.apply`)."""

    def __init__(self, base, slots: LoraSlots, layer: int, group: str) -> None:
        self.base, self.slots, self.layer, self.group = base, slots, layer, group

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        out = self.base(x, out_dtype) if out_dtype is not None else self.base(x)
        return self.slots.apply(self.layer, self.group, x, out)
