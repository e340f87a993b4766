"""LoRA adapters: one for the whole job (`model.adapter_path`, loaded by mlx-lm's own `load_adapters`),
or several by name (`model.adapters`) that rows pick one of (`Request.adapter`), decoding in one batch.

Per-row adapters keep the base weights once. Every linear layer some adapter targets becomes a
`RowLoRALinear`: the base layer, and each adapter's low-rank pair stacked along a first axis (index 0
is the base model: zeros; ranks padded with zeros to the largest, which adds exact zeros). Before a
forward pass the runner says which adapter each of the pass's rows uses (`Adapters.select`); the layer
adds scale x (x A) B of the rows' adapters: the one pair when every row uses the same adapter (what
mlx-lm's LoRALinear computes), else each row's own pair through `mx.gather_mm` (no copy of the pairs). A
pass whose rows all use the base model adds nothing. The adapters' weights are model parameters, so the
model's weight bytes (the memory model's `weights_bytes`) count them.

An adapter folder is what mlx-lm's tuner writes: adapter_config.json (fine_tune_type lora,
lora_parameters.scale) and adapters.safetensors (`<module path>.lora_a` (in, r), `.lora_b` (r, out)).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from kvbatch.engine.errors import KvbatchConfigError

def load_job_adapter(model: nn.Module, path: str) -> None:
    """`model.adapter_path`: mlx-lm's load_adapters (its LoRA layers, as `mlx_lm.load(adapter_path=...)`
    gives them), then eval mode (no dropout)."""
    from mlx_lm.tuner.utils import load_adapters

    try:
        load_adapters(model, path)
    except (OSError, KeyError, ValueError, TypeError) as exc:
        raise KvbatchConfigError(f"model.adapter_path={path!r}: mlx-lm cannot load the adapter: "
                                 f"{str(exc).splitlines()[0]}") from None
    model.eval()


class Selection:
    """Which adapter each row of the pass being built uses: None (every row the base model), one
    adapter index for all rows (`one`), or an index per row (`rows`, (B,))."""

    def __init__(self) -> None:
        self.one: Optional[int] = None
        self.rows: Optional[mx.array] = None


class RowLoRALinear(nn.Module):
    """A linear layer plus, per row, the low-rank update of that row's adapter (see the module doc)."""

    def __init__(self, linear: nn.Module, lora_a: mx.array, lora_b: mx.array, scales: mx.array, sel: Selection):
        super().__init__()
        self.linear = linear
        self.lora_a, self.lora_b, self.scales = lora_a, lora_b, scales  # (n+1, in, r), (n+1, r, out), (n+1,)
        self.sel = sel  # shared by every layer; not a parameter

    def __call__(self, x: mx.array) -> mx.array:
        """The base layer's output plus each row's adapter update (none for rows of the base model)."""
        y = self.linear(x)
        sel = self.sel
        if sel.one is not None:
            z = (x @ self.lora_a[sel.one]) @ self.lora_b[sel.one]
            return y + (self.scales[sel.one] * z).astype(x.dtype)
        if sel.rows is None:
            return y
        # (B, L, in) @ (in, r) @ (r, out) with each row's own pair, not copied out (as mlx-lm's SwitchLinear);
        # x in the adapters' dtype, as the one-adapter product promotes it
        xa = mx.gather_mm(x.astype(self.lora_a.dtype), self.lora_a, rhs_indices=sel.rows)
        z = mx.gather_mm(xa, self.lora_b, rhs_indices=sel.rows)
        return y + (self.scales[sel.rows][:, None, None] * z).astype(x.dtype)


class Adapters:
    """A model's named per-row adapters: name -> index (0: the base model), and the selection the layers read."""

    def __init__(self, names: Sequence[str], sel: Selection, nbytes: int):
        self.index = {name: i + 1 for i, name in enumerate(names)}
        self.sel, self.nbytes = sel, nbytes

    def select(self, indices: Sequence[int]) -> None:
        """The next forward pass's rows use these adapters (0: the base model)."""
        first = indices[0] if indices else 0
        if all(i == first for i in indices):
            self.sel.one, self.sel.rows = (first or None), None
        else:
            self.sel.one, self.sel.rows = None, mx.array(list(indices))


ATTR = "_kvbatch_adapters"  # where install() leaves the model's Adapters


def of(model: nn.Module) -> Optional[Adapters]:
    """The model's per-row adapters (None: it has none)."""
    return getattr(model, ATTR, None)


def _read(name: str, path: str) -> tuple[float, dict[str, tuple[mx.array, mx.array]]]:
    """An adapter folder -> (its scale, {module path: (lora_a, lora_b)})."""
    key = f"model.adapters.{name}"
    folder = Path(path).expanduser()
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
        weights = cast(dict, mx.load(str(folder / "adapters.safetensors")))
    except (OSError, ValueError, RuntimeError) as exc:
        raise KvbatchConfigError(f"{key}={path!r}: not an mlx-lm adapter folder (adapter_config.json and "
                                 f"adapters.safetensors): {str(exc).splitlines()[0]}") from None
    kind = config.get("fine_tune_type", "lora")
    scale = (config.get("lora_parameters") or {}).get("scale")
    if kind != "lora" or not isinstance(scale, (int, float)):
        raise KvbatchConfigError(f"{key}={path!r}: per-row adapters are LoRA adapters with "
                                 f"lora_parameters.scale (this one: fine_tune_type {kind}, scale {scale})")
    pairs: dict[str, dict[str, mx.array]] = {}
    for k, w in weights.items():
        module, _, leaf = k.rpartition(".")
        if leaf not in ("lora_a", "lora_b"):
            raise KvbatchConfigError(f"{key}={path!r}: {k} is not a LoRA weight (lora_a, lora_b)")
        pairs.setdefault(module, {})[leaf] = w
    if any(len(p) != 2 for p in pairs.values()):
        raise KvbatchConfigError(f"{key}={path!r}: a module has lora_a without lora_b (or the reverse)")
    return float(scale), {m: (p["lora_a"], p["lora_b"]) for m, p in pairs.items()}


def _dims(linear: Any) -> tuple[int, int]:
    """(input, output) dimensions of a linear layer (a quantized one packs its input in 32-bit words)."""
    out_dims, in_dims = linear.weight.shape
    if isinstance(linear, nn.QuantizedLinear):
        in_dims = in_dims * 32 // linear.bits
    return in_dims, out_dims


def install(model: nn.Module, adapters: dict[str, str]) -> Adapters:
    """Per-row adapters (`model.adapters`: name -> folder): every targeted linear layer becomes a
    RowLoRALinear holding all of them; KvbatchConfigError naming the adapter that does not fit."""
    names = sorted(adapters)
    read = {name: _read(name, adapters[name]) for name in names}
    modules = dict(model.named_modules())
    targets = sorted({m for _, pairs in read.values() for m in pairs})
    sel, nbytes, layers = Selection(), 0, []
    for path in targets:
        linear = modules.get(path)
        if not isinstance(linear, (nn.Linear, nn.QuantizedLinear)):
            who = [n for n in names if path in read[n][1]][0]
            raise KvbatchConfigError(f"model.adapters.{who}: {path} is not a linear layer of the model")
        in_dims, out_dims = _dims(linear)
        rank = max(read[n][1][path][0].shape[1] for n in names if path in read[n][1])
        dtype = next(read[n][1][path][0].dtype for n in names if path in read[n][1])
        a = [mx.zeros((in_dims, rank), dtype=dtype)]
        b = [mx.zeros((rank, out_dims), dtype=dtype)]
        for n in names:
            pair = read[n][1].get(path)
            if pair is None:
                a.append(a[0])
                b.append(b[0])
                continue
            la, lb = pair
            r = la.shape[1]
            if la.shape[0] != in_dims or lb.shape != (r, out_dims):
                raise KvbatchConfigError(f"model.adapters.{n}: {path} has lora_a {tuple(la.shape)}, lora_b "
                                         f"{tuple(lb.shape)}; the layer is {in_dims} -> {out_dims}")
            a.append(mx.pad(la.astype(dtype), [(0, 0), (0, rank - r)]))
            b.append(mx.pad(lb.astype(dtype), [(0, rank - r), (0, 0)]))
        scales = mx.array([0.0] + [read[n][0] for n in names], dtype=dtype)
        layer = RowLoRALinear(linear, mx.stack(a), mx.stack(b), scales, sel)
        nbytes += layer.lora_a.nbytes + layer.lora_b.nbytes + scales.nbytes
        layers.append((path, layer))
    model.update_modules(tree_unflatten(layers))
    mx.eval(model.parameters())
    found = Adapters(names, sel, nbytes)
    setattr(model, ATTR, found)
    return found
