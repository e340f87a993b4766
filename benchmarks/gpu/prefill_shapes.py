"""Where a mixed-length prefill's time goes on a GPU: each pass's shape and seconds, cold and warm.

256 random prompts of 20-996 tokens (most short), prefilled by the engine (max_tokens=1) twice in
one process with fresh engines, then other prompts of the same spread ("new_shapes"): when the second
run is much faster than the first and the third is as slow as the first, passes pay for shapes met
for the first time (kernel compilation, library plans), not for compute. Each
pass is listed as (rows, padded length L, keys its rows held before it, seconds), and the seconds of the
passes over earlier keys (later chunks of longer prompts) apart from the first chunks'. `--modes` A/Bs engine options as
the harness's mode strings do ("none", "none@prefill_buckets=false", "q8"). `--spread uniform` draws
lengths uniformly, as the whole-job benchmark's rows (52-2,018 there): the skewed default has a mean a third of
the way from the shortest to the longest, fewer rows over one prefill chunk.

    python -m benchmarks gpu.prefill_shapes --geometry 1b --rows 256 --modes none,q8 --out prefill.json
    python -m benchmarks gpu.prefill_shapes --min-len 52 --max-len 2018 --spread uniform --new 512 --chunk 512

`--graph-dots DIR` (MLX CUDA) has MLX write each committed CUDA graph as a dot file (MLX_SAVE_CUDA_GRAPHS_DOT_FILE)
and summarises each run's graphs: how many, how many distinct by MLX's cache key (node kinds and edges), and how
many an LRU graph cache of 400 (MLX's default) or 4,000 would instantiate, and the later half's nodes counted by
kernel (`later_half_nodes`: what a decode step encodes); three of each run's files are kept.
Writing the files slows the run: its seconds are not comparable with a run without them.
"""
from __future__ import annotations

import contextlib
import cProfile
import json
import os
import pstats
import random
import re
import shutil
import time
from collections import Counter, OrderedDict
from pathlib import Path

import mlx.core as mx

from benchmarks import harness as h

SMOKE = ["--geometry", "tiny", "--rows", "3", "--max-len", "40", "--attempts", "2", "--cprofile", "3"]


def add_args(ap) -> None:
    ap.add_argument("--geometry", default="1b", help=", ".join(h.GEOMETRIES))
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=996, help="longest prompt (shortest: 20)")
    ap.add_argument("--modes", default="none")
    ap.add_argument("--new", type=int, default=1, help="new tokens per row (1: prefill only)")
    ap.add_argument("--min-len", type=int, default=20, help="shortest prompt")
    ap.add_argument("--chunk", type=int, default=2048,
                    help="engine.prefill_chunk (the command's default is 512: longer prompts continue over passes)")
    ap.add_argument("--pass-tokens", default="auto", help="engine.prefill_tokens: tokens of one pass, all rows")
    ap.add_argument("--attempts", type=int, default=3, help="runs a mode: cold, then warm, then new shapes")
    ap.add_argument("--spread", choices=("skewed", "uniform"), default="skewed",
                    help="prompt lengths: skewed short (shortest + (longest - shortest) u^2, u uniform; mean a third "
                         "of the way) or uniform between shortest and longest, as the whole-job benchmark's rows")
    ap.add_argument("--graph-dots", default="", help="folder for MLX's CUDA graph dumps (see the module's text)")
    ap.add_argument("--cprofile", type=int, default=0,
                    help="also cProfile each mode's first run: its N functions of most cumulative and of most own "
                         "time (`cprofile`: [cumulative, own] s), and its `outside_s`: the run's seconds outside "
                         "prefill passes and decode steps")


def mixed_prompts(n: int, vocab: int, longest: int, seed: int = 0, shortest: int = 20,
                  spread: str = "skewed") -> list[list[int]]:
    """n prompts of random tokens, lengths from shortest to longest: most short (skewed) or uniform."""
    rnd = random.Random(seed)
    if spread == "skewed":  # the draws every earlier record of this benchmark used
        return [[rnd.randrange(vocab) for _ in range(shortest + int((longest - shortest) * rnd.random() ** 2))]
                for _ in range(n)]
    return [[rnd.randrange(vocab) for _ in range(rnd.randint(shortest, longest))] for _ in range(n)]


def one(model, spec, ps, mode: str, budget: int, new: int, chunk: int = 2048, pass_tokens: str = "auto",
        cprofile: int = 0) -> dict:
    passes = h.PassTimes()
    eng = h.engine(model, h.NoEos(), spec, mode, hooks=passes, page_size=64, max_batch=len(ps), prefill_chunk=chunk,
                   prefill_tokens=pass_tokens if pass_tokens == "auto" else int(pass_tokens),
                   memory_budget=budget, allow_unvalidated=True)
    prof = cProfile.Profile() if cprofile else None
    passes.mark()
    t0 = time.perf_counter()
    with prof or contextlib.nullcontext():
        res = eng.generate(h.requests(ps, new))
    wall = time.perf_counter() - t0
    s = eng.summary()
    extra = {"cprofile": top_functions(prof, cprofile)} if prof else {}
    return {**extra, "mode": mode, "wall_s": wall, "outside_s": wall - s["prefill_s"] - s["decode_s"],
            "growth_s": round(sum(g["seconds"] for g in s["growth_events"]), 3), "growths": len(s["growth_events"]),
            "later": later_share(passes.passes), "prefill_s": s["prefill_s"],
            "decode_s": s["decode_s"],
            "prefill_tps": s["prefill_tokens_per_s"], "decode_tps": s["decode_tokens_per_s"],
            "prompt_tokens": sum(map(len, ps)), "generated": sum(len(r.tokens) for r in res),
            "errors": [r.error_code for r in res if r.error_code], "cache_clears": s["cache_clears"],
            "decode_steps": passes.step_summary(), "engine_steps": passes.uncounted_summary(),
            "passes": passes.passes}


def top_functions(prof: cProfile.Profile, n: int) -> dict:
    """The n functions of most cumulative time and the n of most own time: "file:line:name" -> [cumulative, own] s."""
    st = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    picked = (sorted(st.items(), key=lambda kv: -kv[1][3])[:n] + sorted(st.items(), key=lambda kv: -kv[1][2])[:n])
    return {f"{Path(f).name}:{ln}:{fn}": [round(v[3], 3), round(v[2], 3)] for (f, ln, fn), v in picked}


_DECL = re.compile(r'^\s*"?(\w+)"?\s*\[', re.M)
_EDGE = re.compile(r'"?(\w+)"?\s*->\s*"?(\w+)"?')
_NAME = re.compile(r'label="\d+\n([^\n"]*)')  # a node's kernel (or kind): its label's second line
_KIND = re.compile(r"cudaGraphNodeType(\w+)|\b([A-Z][A-Z_]{2,})\b")


def graph_key(text: str) -> tuple[tuple, tuple, int, bool]:
    """One dot file's graph: (node kinds and edges, as MLX's graph cache keys it), (each node's text with
    numbers and addresses blanked, and the edges: the kernels included), its node count, whether a node names a
    cluster shape."""
    decls = [m for m in _DECL.finditer(text) if m.group(1) not in ("node", "edge", "graph")]
    index = {m.group(1): i for i, m in enumerate(decls)}
    kinds, texts, cluster = [], [], False
    for m, nxt in zip(decls, decls[1:] + [None]):
        body = text[m.end():nxt.start() if nxt else len(text)]
        body = _EDGE.sub("", body)
        k = _KIND.search(body)
        kinds.append((k.group(1) or k.group(2)) if k else "?")
        texts.append(re.sub(r"\d+", "#", re.sub(r"0x[0-9a-fA-F]+", "", body)).strip())
        cluster |= bool(re.search(r"cluster(?!_)", body, re.I))  # (a child graph is drawn as `subgraph cluster_N`)
    edges = tuple(sorted((index[a], index[b]) for a, b in _EDGE.findall(text) if a in index and b in index))
    return (tuple(kinds), edges), (tuple(texts), edges), len(decls), cluster


def lru_misses(keys: list, capacity: int) -> int:
    """How many of these graphs a least-recently-used cache of `capacity` executables instantiates."""
    cache: OrderedDict = OrderedDict()
    misses = 0
    for k in keys:
        if k in cache:
            cache.move_to_end(k)
            continue
        misses += 1
        cache[k] = None
        if len(cache) > capacity:
            cache.popitem(last=False)
    return misses


def dot_index(p: Path) -> int:
    """The commit's number in MLX's dump name (<prefix>_<n>.dot)."""
    return int(p.stem.rsplit("_", 1)[1])


def graph_dots(folder: Path, tag: str, lru: OrderedDict) -> dict:
    """Summarise (then delete, keeping the first, middle and last) the dot files MLX wrote since the last call.
    `lru` holds the keys of earlier runs in order, so the cache misses count what the process's cache held."""
    files = sorted(folder.glob("g_*.dot"), key=dot_index)
    if not files:
        return {"graphs": 0}
    tops, fulls, nodes, clusters = [], [], [], 0
    names: Counter = Counter()  # the later half's nodes by kernel (decode, where the rows all start at once)
    for i, f in enumerate(files):
        text = f.read_text(errors="replace")
        top, full, n, cluster = graph_key(text)
        tops.append(top)
        fulls.append(full)
        nodes.append(n)
        clusters += cluster
        if i >= len(files) // 2:
            names.update(name[:90] for name in _NAME.findall(text))
    keep = folder / "kept"
    keep.mkdir(exist_ok=True)
    for f in {files[0], files[len(files) // 2], files[-1]}:
        shutil.copy(f, keep / f"{tag}_{f.name}")
    for f in files:
        f.unlink()
    history = list(lru)
    out = {"later_half_nodes": names.most_common(60),
           "graphs": len(files), "distinct_keys": len(set(tops)), "distinct_with_kernels": len(set(fulls)),
           "nodes_median": sorted(nodes)[len(nodes) // 2], "graphs_naming_clusters": clusters,
           "kinds": sorted({k for t in tops for k in t[0]}),
           "new_keys_by_eighth": [len(set(tops[i:i + max(1, len(tops) // 8)]) - set(tops[:i]) - set(history))
                                  for i in range(0, len(tops), max(1, len(tops) // 8))]}
    for cap in (400, 4000):
        out[f"lru{cap}_instantiations"] = lru_misses(history[-cap:] + tops, cap) - len(set(history[-cap:]))
    for k in tops:
        lru[k] = None
        lru.move_to_end(k)
    return out


def later_share(passes: list[dict]) -> dict:
    """The passes that continue rows (their rows held keys before: later prefill chunks) against the rest."""
    later = [p for p in passes if p["before"]]
    return {"later_passes": len(later), "later_s": round(sum(p["s"] for p in later), 3),
            "first_s": round(sum(p["s"] for p in passes if not p["before"]), 3),
            "later_keys_before": sum(p["before"] for p in later)}


def run(a) -> dict:
    dots = Path(a.graph_dots) if a.graph_dots else None
    if dots:  # MLX reads it at its first commit: before the model's weights are made
        dots.mkdir(parents=True, exist_ok=True)
        os.environ["MLX_SAVE_CUDA_GRAPHS_DOT_FILE"] = str(dots / "g")
    lru: OrderedDict = OrderedDict()
    model, spec = h.build_random(a.geometry)
    if dots:
        for f in dots.glob("g_*.dot"):  # the model's own graphs
            f.unlink()
    ps = mixed_prompts(a.rows, spec.vocab_size, a.max_len, shortest=a.min_len, spread=a.spread)
    budget = int(mx.device_info().get("memory_size", 80 << 30) * 0.8)
    out = []
    for mode in a.modes.split(","):
        h.parse_mode(mode)  # fail early on a bad mode string
        other = mixed_prompts(a.rows, spec.vocab_size, a.max_len, 1, a.min_len, a.spread)
        for attempt, prompts in (("cold", ps), ("warm", ps), ("new_shapes", other))[:a.attempts]:
            r = one(model, spec, prompts, mode, budget, a.new, a.chunk, a.pass_tokens,
                    a.cprofile if attempt == "cold" else 0)
            r["attempt"] = attempt
            if dots:
                r["graph_dots"] = graph_dots(dots, f"{mode}_{attempt}", lru)
            out.append(r)
            print(json.dumps({k: v for k, v in r.items() if k not in ("passes", "cprofile")}), flush=True)
            if "cprofile" in r:
                print("  cprofile [cumulative, own] s:", json.dumps(r["cprofile"]), flush=True)
            print("  passes:", [(p["rows"], p["L"], p["before"], p["s"]) for p in r["passes"]], flush=True)
            print("  passes over earlier keys:", r["later"], flush=True)
            h.checkpoint({"runs": out})
    return {"runs": out}
