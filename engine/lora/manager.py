"""Which LoRA adapters exist, which are in host memory, and which sit in device slots.

Owns: the registry of adapters (name → PEFT directory, from `--lora-modules` or loaded at run
time), an LRU of up to `max_cpu_loras` adapters read into host memory, and the assignment of
adapters to the `max_loras` device slots of `engine.lora.slots.LoraSlots` (LRU over steps: a slot
is reused only for an adapter the current step needs, and never while its adapter is in that
step). The scheduler keeps the running requests' distinct adapters within `max_loras`, so every
step's adapters fit.

In: adapter names per step (`activate`), registrations. Out: slot numbers; `LoraError` for an
adapter that cannot be served. `build_lora` sets it all up on a model (rank 0 and every
tensor-parallel rank alike: a rank reads each adapter itself and keeps its shard of it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.lora.adapter import LoraAdapter, load_adapter
from engine.lora.errors import LoraError
from engine.lora.slots import LoraBatch, LoraSlots


@dataclass(frozen=True)
class LoraSpec:
    """The LoRA flags every rank builds its slots from (`engine.config.EngineConfig`'s)."""

    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int
    modules: tuple[tuple[str, str], ...] = ()      # (name, PEFT directory) served at start


@dataclass(frozen=True)
class LoraUpdate:
    """An adapter registered ("load", with its PEFT directory) or unregistered ("unload") at
    run time on rank 0, which has read and checked it already; every tensor-parallel rank
    applies it (`LoraManager.update`, reading its own shard) before the next step."""

    op: str
    name: str
    path: str | None = None


class LoraManager:
    """See the module docstring. `model_cfg` is the base model's (whole) `ModelConfig`, which
    adapters are checked against; `slots` its device pool; `shard`, under tensor parallelism,
    turns an adapter's whole weights into this rank's (`parallel.shard_lora`)."""

    def __init__(self, model_cfg, slots: LoraSlots, max_cpu_loras: int,
                 shard: Callable[[dict], dict] | None = None) -> None:
        self.model_cfg, self.slots, self.shard = model_cfg, slots, shard
        self.max_cpu_loras = max(max_cpu_loras, slots.max_loras)
        self.paths: dict[str, str] = {}
        self.retired: dict[str, str] = {}      # unloaded while requests may still hold them
        self.cpu: OrderedDict[str, LoraAdapter] = OrderedDict()
        self.slot_of: OrderedDict[str, int] = OrderedDict()     # least recently used first
        self.loads = 0                                         # slot loads so far

    @property
    def names(self) -> list[str]:
        """The registered adapters, in registration order."""
        return list(self.paths)

    def register(self, name: str, path: str) -> None:
        """Add adapter `name` from the PEFT directory `path`, read and checked now.
        Raises: LoraError (a bad adapter, or a name already registered)."""
        if name in self.paths:
            raise LoraError(f"LoRA adapter {name!r} is already loaded")
        adapter = self._read(name, path)
        self.paths[name] = str(path)
        self.retired.pop(name, None)
        self.slot_of.pop(name, None)         # a name loaded again: its new weights from now
        self._keep(adapter)

    def unregister(self, name: str) -> None:
        """Stop serving adapter `name` to new requests; requests already holding it finish
        with it (its weights stay until its slot is reused). Raises: LoraError if unknown."""
        path = self.paths.pop(name, None)
        if path is None:
            raise LoraError(f"LoRA adapter {name!r} is not loaded")
        self.retired[name] = path

    def update(self, update: LoraUpdate) -> None:
        """Apply a `LoraUpdate`. Raises: LoraError as `register` / `unregister`."""
        if update.op == "load":
            self.register(update.name, update.path)
        else:
            self.unregister(update.name)

    def _read(self, name: str, path: str) -> LoraAdapter:
        adapter = load_adapter(name, path, self.model_cfg, self.slots.max_rank)
        if self.shard is not None:
            adapter.weights = self.shard(adapter.weights)
        return adapter

    def _keep(self, adapter: LoraAdapter) -> None:
        self.cpu[adapter.name] = adapter
        self.cpu.move_to_end(adapter.name)
        while len(self.cpu) > self.max_cpu_loras:
            self.cpu.popitem(last=False)

    def _adapter(self, name: str) -> LoraAdapter:
        adapter = self.cpu.get(name)
        if adapter is None:                  # evicted from host memory: read it again
            path = self.paths.get(name) or self.retired[name]
            adapter = self._read(name, path)
        self._keep(adapter)
        return adapter

    def activate(self, names: set[str]) -> dict[str, int]:
        """Slots for the adapters a step needs, loading those not in a slot into the least
        recently used slot no name in `names` holds. Raises: LoraError for an unknown name or
        more names than slots."""
        if len(names) > self.slots.max_loras:
            raise LoraError(f"{len(names)} adapters in one step; --max-loras is "
                            f"{self.slots.max_loras}")
        for name in names:
            if name not in self.paths and name not in self.retired:
                raise LoraError(f"LoRA adapter {name!r} is not loaded")
            if name in self.slot_of:
                self.slot_of.move_to_end(name)
                continue
            used = set(self.slot_of.values())
            free = [s for s in range(self.slots.max_loras) if s not in used]
            if free:
                slot = free[0]
            else:
                victim = next(n for n in self.slot_of if n not in names)
                slot = self.slot_of.pop(victim)
            self.slots.load(slot, self._adapter(name))
            self.slot_of[name] = slot
            self.loads += 1
        return {name: self.slot_of[name] for name in names}

    def set_batch(self, row_adapters: list[tuple[str | None, int, int]]) -> None:
        """The step's rows: (adapter name or None, first row, row count) per request, in row
        order: each row's slot for the kernels, and the rows of each slot for the torch path
        (a slice where they are contiguous)."""
        names = {n for n, _, _ in row_adapters if n is not None}
        if not names:
            self.slots.batch = None
            return
        slot_of = self.activate(names)
        row_slot = [-1] * sum(count for _, _, count in row_adapters)
        for name, start, count in row_adapters:
            if name is not None:
                row_slot[start:start + count] = [slot_of[name]] * count
        device = self.slots.a[0]["qkv"].device
        batch = LoraBatch(torch.tensor(row_slot, dtype=torch.int32, device=device))
        if self.slots.kernels is None:           # the kernels read row_slot alone
            batch.groups = self._groups(row_adapters, slot_of, device)
        self.slots.batch = batch

    @staticmethod
    def _groups(row_adapters, slot_of: dict[str, int], device) -> list:
        """(slot, rows) per slot for the torch path: a slice where its rows are contiguous."""
        spans: dict[int, list[tuple[int, int]]] = {}
        for name, start, count in row_adapters:
            if name is None or not count:
                continue
            mine = spans.setdefault(slot_of[name], [])
            if mine and mine[-1][1] == start:
                mine[-1] = (mine[-1][0], start + count)
            else:
                mine.append((start, start + count))
        groups = []
        for slot, ranges in spans.items():
            groups.append((slot, slice(*ranges[0]) if len(ranges) == 1 else torch.cat(
                [torch.arange(a, b) for a, b in ranges]).to(device)))
        return groups


def build_lora(model, model_cfg, device, dtype: torch.dtype, spec: LoraSpec,
               tp=None) -> LoraManager:
    """LoRA slots on `model` (a `LlamaForCausalLM`, this rank's shard under `tp`, an
    `engine.distributed.TensorParallelGroup`) on `device` (`engine.device.Device`), and the
    manager with `spec.modules` registered, adapters checked against the whole model's
    `model_cfg`. Slot weights are kept in `dtype` where the CPU kernels compute the deltas,
    else in float32. Raises: LoraError (a bad adapter, naming it)."""
    kernels = device.kernels(dtype)
    slots = LoraSlots(model.cfg, spec.max_loras, spec.max_lora_rank, device.torch_device,
                      kernels, dtype if kernels is not None else torch.float32)
    model.enable_lora(slots)
    shard = None
    if tp is not None:
        from engine.distributed.parallel import shard_lora

        def shard(weights: dict) -> dict:
            return shard_lora(model_cfg, weights, tp.rank, tp.world_size)
    manager = LoraManager(model_cfg, slots, spec.max_cpu_loras, shard)
    for name, path in spec.modules:
        manager.register(name, path)
    return manager
