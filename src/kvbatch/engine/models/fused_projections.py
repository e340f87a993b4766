"""Projections that read the same input, run as one matmul: an attention's q/k/v and a SwiGLU MLP's gate/up.

A decode step at a large batch is bound by the host on a GPU: every kernel of every layer costs MLX's
dispatch (~10-20 us of host time each) whatever its size, and a SmolLM2 step at 1,024 rows is ~16 kernels
a layer x 30 layers. The three q/k/v matmuls of a layer become one over their weights concatenated along
the output axis, and gate/up another: three kernels a layer fewer, and larger matmuls. Each output column
is the same dot product as before, so the numbers are those of the separate matmuls on the CPU (checked
bit for bit by the tests); a GPU library may pick another algorithm for the larger shape.

mlx-lm's model code is left as it is: the projections become `Part`s of a `FusedGroup` held by their
parent module (so the parameters stay in the model's tree, counted once), and the first part called with
an input computes the whole group's output; the others take their slice of it when called with the same
input (any other input, or a part asked twice, computes it again). Only groups whose members are all plain
`nn.Linear` or all `nn.QuantizedLinear` of one quantization are fused; a LoRA-wrapped projection
(engine/lora.py) keeps its group apart.
"""
from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn

GROUPS = {"fused_qkv": ("q_proj", "k_proj", "v_proj"), "fused_gate_up": ("gate_proj", "up_proj")}


class FusedGroup(nn.Module):
    """The projections of one group as one layer of their own kind, weights concatenated along the output axis."""

    def __init__(self, members: list[nn.Module], names: tuple[str, ...]):
        super().__init__()
        first = members[0]
        # a Linear or QuantizedLinear of the members' kind: its own __call__ (bias, quantization) runs the group
        self.layer = _like(first)
        for key in first:
            self.layer[key] = mx.concatenate([m[key] for m in members], axis=0)
        self.names = names
        rows = [m["weight"].shape[0] for m in members]
        self.memo = _Memo(self.layer, [sum(rows[:i + 1]) for i in range(len(rows) - 1)])

    def members(self) -> list[nn.Module]:
        """The projections as separate layers again (each its rows of the group's arrays)."""
        out, starts = [], [0] + self.memo.cuts
        ends = self.memo.cuts + [self.layer["weight"].shape[0]]
        for a, b in zip(starts, ends):
            m = _like(self.layer)
            for key in self.layer:
                m[key] = self.layer[key][a:b]
            out.append(m)
        return out


def _like(layer: nn.Module) -> nn.Module:
    """An empty layer of `layer`'s class with its settings (group_size, bits, mode, ...), no arrays."""
    m = type(layer).__new__(type(layer))
    nn.Module.__init__(m)
    for key, value in vars(layer).items():
        object.__setattr__(m, key, value)
    return m


class _Memo:
    """The group's output for the input it was last called with, until every part took its slice. A plain
    object (an nn.Module keeps arrays and lists in its dict, a slower path on every read and write)."""

    __slots__ = ("layer", "cuts", "x", "parts", "left")

    def __init__(self, layer: nn.Module, cuts: list[int]):
        self.layer, self.cuts = layer, cuts
        self.x: Optional[mx.array] = None
        self.parts: list[Optional[mx.array]] = []
        self.left = 0

    def take(self, x: mx.array, i: int) -> mx.array:
        """Member i's output for x: its slice of the group's output, computed once for the parts that share x."""
        parts = self.parts
        if x is not self.x or parts[i] is None:
            parts = self.parts = list(mx.split(self.layer(x), self.cuts, axis=-1))
            self.x, self.left = x, len(parts)
        out, parts[i] = parts[i], None
        self.left -= 1
        if not self.left:
            self.x = None  # every part took its slice: hold no array past the layer
        assert out is not None  # computed above when it was taken
        return out


class Part(nn.Module):
    """One projection of a FusedGroup, called as the projection was."""

    def __init__(self, group: FusedGroup, index: int):
        super().__init__()
        self.index = index
        self.memo = group.memo  # a plain object: outside the module tree (the group's arrays are its parent's)

    def __call__(self, x: mx.array) -> mx.array:
        """The projection's output (its slice of the group's)."""
        return self.memo.take(x, self.index)


def _fusable(members: list) -> bool:
    first = members[0]
    if type(first) not in (nn.Linear, nn.QuantizedLinear):
        return False
    keys, attrs = set(first), {k: v for k, v in vars(first).items() if not k.startswith("_")}
    return all(type(m) is type(first) and set(m) == keys and {k: v for k, v in vars(m).items()
                                                               if not k.startswith("_")} == attrs
               and all(m[k].shape[1:] == first[k].shape[1:] and m[k].dtype == first[k].dtype for k in keys)
               for m in members)


def install(model: nn.Module) -> int:
    """Fuse every group the model's modules hold (idempotent). Returns how many groups are fused."""
    fused = 0
    for _, module in model.named_modules():
        for attr, names in GROUPS.items():
            if isinstance(module.get(attr), FusedGroup):
                fused += 1
                continue
            members = [module.get(n) for n in names]
            if any(m is None for m in members) or not _fusable(members):
                continue
            group = FusedGroup(members, names)
            mx.eval(group.parameters())  # the concatenated weights exist before the separate ones go
            setattr(module, attr, group)
            for i, n in enumerate(names):
                setattr(module, n, Part(group, i))
            fused += 1
    return fused


def uninstall(model: nn.Module) -> None:
    """Separate projections again (benchmarks run mlx-lm on the model as it ships)."""
    for _, module in model.named_modules():
        for attr in GROUPS:
            group = module.get(attr)
            if not isinstance(group, FusedGroup):
                continue
            for n, m in zip(group.names, group.members()):
                setattr(module, n, m)
            del module[attr]
