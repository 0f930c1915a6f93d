"""The device pool of LoRA slots and the per-step LoRA delta on top of the base linears.

Owns: for every layer and projection group of the model (`qkv`, `o`, `gate_up`, `down`: the
model's fused linears), stacked weights `A [max_loras, R_g, in]` and `Bt [max_loras, R_g, out]`
(B transposed, its scaling folded in; in the model's dtype) allocated once; a group of k
modules has `R_g = k x max_rank` rank rows, each module's in its own `max_rank` band feeding only
its own output columns (`bands`); which slot holds which module of which layer (`present`); and
the step's row → slot assignment (`LoraBatch`).

The delta is punica's segmented gather matrix-vector product (Chen et al., arXiv:2310.18547;
vLLM's `punica_cpu`): for each row of slot s, `out += (x @ A[s].T) @ Bt[s]` band by band. On the
CPU kernels it is one call per projection for the whole step, whatever the adapters
(`engine/kernels/lora.c`); elsewhere torch, per slot group of rows. Rows of the base model
(slot -1) pay nothing.

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
    """The step's rows: `row_slot [T] int32` (-1: the base model) for the kernels (with its
    address and the step's thread count, read once), and `groups` of (slot, rows) for the
    torch path, rows a slice or an int64 index tensor."""

    row_slot: torch.Tensor
    groups: list[tuple[int, slice | torch.Tensor]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.row_slot_ptr = self.row_slot.data_ptr()
        self.num_threads = torch.get_num_threads()


class LoraSlots:
    """`max_loras` slots for adapters of rank ≤ `max_rank` on a model of `cfg`, on `device`;
    `kernels` (`engine.kernels.CpuKernels` or None) computes the deltas where it exists. The
    weights are kept in `dtype` (the model's: bfloat16 halves the bytes a step reads; the
    kernels sum in float32)."""

    def __init__(self, cfg, max_loras: int, max_rank: int, device: torch.device,
                 kernels=None, dtype: torch.dtype = torch.float32) -> None:
        self.max_loras, self.max_rank, self.kernels = max_loras, max_rank, kernels
        self.dtype = dtype                 # of the slot weights
        shapes = module_shapes(cfg)
        self.offsets: dict[str, int] = {}          # module -> first output column in its group
        self.bands: dict[str, torch.Tensor] = {}   # group -> [modules, 4] int32 (r0, r1, c0, c1)
        for group, modules in GROUPS.items():
            col, rows = 0, []
            for i, m in enumerate(modules):
                self.offsets[m] = col
                rows.append([i * max_rank, (i + 1) * max_rank, col, col + shapes[m][1]])
                col += shapes[m][1]
            self.bands[group] = torch.tensor(rows, dtype=torch.int32)
        self.a: list[dict[str, torch.Tensor]] = []
        self.bt: list[dict[str, torch.Tensor]] = []
        for _ in range(cfg.num_layers):
            a, bt = {}, {}
            for group, modules in GROUPS.items():
                n_in = shapes[modules[0]][0]
                n_out = sum(shapes[m][1] for m in modules)
                a[group] = torch.zeros(max_loras, len(modules) * max_rank, n_in, dtype=dtype,
                                       device=device)
                bt[group] = torch.zeros(max_loras, len(modules) * max_rank, n_out, dtype=dtype,
                                        device=device)
            self.a.append(a)
            self.bt.append(bt)
        # present[layer][group][slot]: 1 when the slot's adapter has weights there
        self.present = torch.zeros(cfg.num_layers, len(GROUPS), max_loras, dtype=torch.int32)
        # per layer and group, a view of its present[] row (set in place by `load`)
        self._present = [{g: self.present[layer, i] for i, g in enumerate(GROUPS)}
                         for layer in range(cfg.num_layers)]
        self._group_index = {g: i for i, g in enumerate(GROUPS)}
        self.batch: LoraBatch | None = None
        # per layer and group, the kernel with that projection's weights bound (CPU only)
        self._sgmv = [{g: kernels.lora_sgmv_bound(self._present[layer][g], self.a[layer][g],
                                                  self.bt[layer][g], self.bands[g])
                       for g in GROUPS} for layer in range(cfg.num_layers)] \
            if kernels is not None and torch.device(device).type == "cpu" else None

    @property
    def nbytes(self) -> int:
        """Memory of the pool (bytes)."""
        return sum(t.nbytes for d in self.a + self.bt for t in d.values())

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy `adapter` into `slot` (whatever was there is cleared)."""
        r = self.max_rank
        for a, bt in zip(self.a, self.bt):
            for group in GROUPS:
                a[group][slot].zero_()
                bt[group][slot].zero_()
        self.present[:, :, slot] = 0
        for (layer, module), (a_w, b_w) in adapter.weights.items():
            group = next(g for g, ms in GROUPS.items() if module in ms)
            band = GROUPS[group].index(module) * r
            rank, col = a_w.shape[0], self.offsets[module]
            self.a[layer][group][slot, band:band + rank] = a_w
            self.bt[layer][group][slot, band:band + rank, col:col + b_w.shape[0]] = b_w.T
            self.present[layer, self._group_index[group], slot] = 1

    def apply(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (`[T, out]`, the base linear's result for `x [T, in]`) plus each row's
        adapter delta for this layer's `group`, in place."""
        batch = self.batch
        if batch is None:
            return out
        if self._sgmv is not None and x.stride(1) == 1 and out.stride(1) == 1 \
                and x.dtype == out.dtype == self.dtype:
            self._sgmv[layer][group](x, out, batch.row_slot_ptr, batch.num_threads)
            return out
        present = self._present[layer][group]
        a, bt = self.a[layer][group], self.bt[layer][group]
        for slot, rows in batch.groups:
            if not present[slot]:
                continue
            delta = ((x[rows].float() @ a[slot].float().T) @ bt[slot].float()).to(out.dtype)
            if isinstance(rows, slice):
                out[rows] += delta
            else:
                out.index_add_(0, rows, delta)
        return out


class LoraLinear:
    """A base `engine.linear.Linear` of one layer and group, followed by the LoRA deltas of
    the step's adapters (`LoraSlots.apply`)."""

    def __init__(self, base, slots: LoraSlots, layer: int, group: str) -> None:
        self.base, self.slots, self.layer, self.group = base, slots, layer, group

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        out = self.base(x, out_dtype) if out_dtype is not None else self.base(x)
        return self.slots.apply(self.layer, self.group, x, out)
