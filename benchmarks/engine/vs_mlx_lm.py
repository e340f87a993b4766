"""kvbatch's Engine against mlx-lm's BatchGenerator: same model, prompts and machine, one process (issues 3, 9).

Merged from engine_vs_mlx_lm.py (CPU: SmolLM2 and a 4M random llama), gpu.py (random bf16 1B/8B geometries,
KV modes, roofline, 8k context) and cpu_decode_ab.py (an engine option off and on against mlx-lm).

Per model (--models: harness MODELS names or random-<1b|8b|tiny>) and batch, both sides generate exactly
--new tokens for the same random --prompt-token prompts (EOS off, greedy). The sides are mlx-lm and one
kvbatch engine per --modes entry: a KV mode (none, q8, q4, k8v4, q4+rot...) with engine options after '@'
('none@in_place=false', 'q8@cuda.warps=8+cuda.unroll=2'): an A/B of an engine option is two modes. Each side
warms up first (kernels compiled for these shapes), then --rounds rounds, the order reversed every other
round; per side the median of every figure over the rounds (decode tok/s by its own counter: `decode_tps`; by
wall time less prefill: `decode_tps_wall`; the whole call: `e2e_tps`; prefill...) with every round's value in
`<figure>_runs`, and against mlx-lm the ratio of medians and round-by-round ratios.
Also: peak memory, KV bytes held at peak against the tokens stored (target: held <= needed + one page per
row), whether the rows' tokens equal mlx-lm's, and (--roofline) the fraction of the memory-bandwidth roofline
(weights + KV read per step / measured copy bandwidth).

Long context (--long N --long-batches B): the same at N-token prompts (--long-new tokens); kvbatch runs
before mlx-lm there (mlx-lm ran out of GPU memory first); --interleave K runs the kvbatch modes' engines at
once, with mlx-lm's BatchGenerator beside them, decoding in alternating blocks of K steps with every row decoding
(harness.interleave): steady-state decode steps compared round by round (`ratio_runs`), past the drift.

    python -m benchmarks engine.vs_mlx_lm --models tiny-4m,smollm2 --batches 1,8,32 --out /tmp/evm.json
    python -m benchmarks engine.vs_mlx_lm --models tiny-4m --batches 8,32 --modes none@in_place=false,none --rounds 3
    python -m benchmarks engine.vs_mlx_lm --models random-1b --batches 1,8,64,256 --modes none,q8,q4 --roofline \\
        --long 8192 --long-batches 1,8 --rounds 2
"""
from __future__ import annotations

import json
import time

import mlx.core as mx

from benchmarks import harness as h
from kvbatch.engine.config import EngineOptions

SMOKE = ["--models", "tiny", "--batches", "2", "--prompt", "8", "--new", "4", "--rounds", "2",
         "--modes", "none,none@in_place=false", "--long", "24", "--long-batches", "2", "--long-new", "4",
         "--interleave", "2", "--roofline", "--bw-mib", "8", "--kv-held"]


def add_args(ap) -> None:
    ap.add_argument("--models", default="tiny-4m,smollm2", help=f"comma-separated: {', '.join(h.MODEL_NAMES)}")
    ap.add_argument("--batches", default="1,8,32", help="'' = none")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--modes", default="none", help="kvbatch sides: KV mode[@option=value+option=value]")
    ap.add_argument("--rounds", type=int, default=2, help="measured rounds, order reversed every other")
    ap.add_argument("--no-mlx-lm", action="store_true", help="kvbatch sides only")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--budget-gb", type=float, default=0, help="engine memory budget (0: auto)")
    ap.add_argument("--long", type=int, default=0, help="long-context prompt tokens (0: no long cases)")
    ap.add_argument("--long-batches", default="1,8")
    ap.add_argument("--long-new", type=int, default=64)
    ap.add_argument("--long-modes", default="", help="modes at long context (default: --modes)")
    ap.add_argument("--skip-mlx-lm-long", action="store_true")
    ap.add_argument("--interleave", type=int, default=0,
                    help="long context: kvbatch modes decode side by side in blocks of this many steps; 0 = off")
    ap.add_argument("--roofline", action="store_true", help="measure copy bandwidth; report roofline fractions")
    ap.add_argument("--bw-mib", type=int, default=2048, help="buffer of the copy-bandwidth measure")
    ap.add_argument("--mlx-lm-prefill-batch", type=int, default=0, help="mlx-lm's prefill_batch_size (0: the batch)")
    ap.add_argument("--kv-held", action="store_true",
                    help="also mlx-lm's KV bytes at peak (read every step: a small cost on its side)")
    ap.add_argument("--cache-limit-gib", type=float, default=2.0,
                    help="CPU: MLX buffer-cache limit for both sides (MLX CPU's default is 32 MiB; the Engine "
                         "raises it to its step workspace, so set it once for both); 0: leave it")


def copy_bandwidth(mib: int) -> float:
    a = mx.random.uniform(shape=(mib << 18,), dtype=mx.float32)
    mx.eval(a)
    for _ in range(2):
        mx.eval(a + 1)
    t, n = time.perf_counter(), 10
    for _ in range(n):
        mx.eval(a + 1)
    return 2 * a.nbytes * n / (time.perf_counter() - t)  # read + write


def warm_tokens(plen: int, new: int, page: int = 64) -> int:
    """New tokens a warm-up needs to seal a page in decode and, if the measured run reaches split-K (rows
    longer than the CUDA kernels' default split: CudaLaunch), to reach it too."""
    launch = EngineOptions().cuda
    need = (plen // page + 1) * page - plen + 2  # the first page filled by decode, sealed, then read
    split = max(launch.chunk, launch.unsplit)
    if plen + new > split:
        need = max(need, split + 2 - plen)
    return max(8, min(new, need))


class Case:
    """One model and batch: its prompts and the engine settings of every kvbatch side."""

    def __init__(self, m, a, batch: int, plen: int, new: int):
        self.model, self.tok, self.spec = m
        self.a, self.batch, self.plen, self.new = a, batch, plen, new
        self.prompts = h.random_prompts(batch, plen, self.spec.vocab_size)

    def engine(self, mode: str):
        a = self.a
        return h.engine(self.model, h.NoEos(), self.spec, mode, page_size=a.page_size, max_batch=self.batch,
                        prefill_chunk=a.prefill_chunk, allow_unvalidated=True,
                        memory_budget=int(a.budget_gb * 1e9) or None)

    def kvbatch(self, mode: str, new: int) -> dict:
        mx.clear_cache()
        mx.reset_peak_memory()
        eng = self.engine(mode)
        t0 = time.perf_counter()
        res = eng.generate(h.requests(self.prompts, new))
        wall = time.perf_counter() - t0
        s = eng.summary()
        n = sum(len(r.tokens) for r in res)
        return {"tokens": n, "wall_s": wall, "prefill_s": s["prefill_s"], "decode_tps": s["decode_tokens_per_s"],
                "decode_tps_wall": n / max(wall - s["prefill_s"], 1e-9), "e2e_tps": n / wall,
                "prefill_tps": s["prefill_tokens_per_s"], "peak_gb": mx.get_peak_memory() / 1e9,
                "route": s["route"], "errors": [r.error_code for r in res if r.error_code],
                "kv_bytes_per_token": s["kv_bytes_per_token"], "page_bytes": h.page_bytes(eng),
                "kv_held": s["peak_pages_in_use"] * h.page_bytes(eng), "kv_pool": s["pool_bytes"],
                "growth_events": len(s["growth_events"]), "lookahead": eng.lookahead,
                "in_place": h.attention_in_place(eng),
                "outputs": [r.tokens for r in res]}

    def mlx_lm(self, new: int) -> dict:
        return h.run_mlx_lm(self.model, self.prompts, new, prefill_batch=min(self.batch, self.a.mlx_lm_prefill_batch
                                                                              or self.batch), kv_held=self.a.kv_held)

    def interleaved(self, modes: list[str], with_mlx_lm: bool) -> dict:
        """Every mode's engine (and mlx-lm's BatchGenerator) alive at once, decoding in alternating blocks
        (harness.interleave): steady-state decode steps with the whole batch decoding, side by side."""
        def maker(mode):
            return lambda: h.Stepper(self.engine(mode), h.requests(self.prompts, self.new))

        make: dict = {m: maker(m) for m in modes}
        if with_mlx_lm:
            make["mlx_lm"] = lambda: h.MlxLmStepper(self.model, self.prompts, self.new,
                                                    min(self.batch, self.a.mlx_lm_prefill_batch or self.batch))
        mx.reset_peak_memory()
        runs = h.interleave(make, self.a.interleave, warm_tokens(self.plen, self.new))
        out, first = {}, runs[modes[0]]["step_s"]
        ref = runs.get("mlx_lm")
        for mode, r in runs.items():
            st = r["stepper"]
            med = h.median_or_none(r["step_s"])
            cell = {"decode_tps": self.batch / med if med else None,
                    "step_ms_runs": [x and x * 1e3 for x in r["step_s"]], "block": self.a.interleave}
            if isinstance(st, h.MlxLmStepper):
                out[mode] = {**cell, "tokens": sum(map(len, st.tokens.values())), "outputs": st.outputs()}
                continue
            res, s = st.results, st.eng.summary()
            by_key = {x.key: x.tokens for x in res}
            ratios = h.paired_ratios(r["step_s"], first)
            cell.update(ratio_vs_first_runs=ratios, ratio_vs_first=h.median_or_none(ratios),
                        tokens=sum(len(x.tokens) for x in res), route=s["route"],
                        errors=([x.error_code for x in res if x.error_code]
                                + ([] if len(res) == self.batch else ["missing"])),
                        kv_bytes_per_token=s["kv_bytes_per_token"], peak_gb=mx.get_peak_memory() / 1e9,
                        outputs=[by_key.get(str(i), []) for i in range(self.batch)])
            if ref is not None:  # round by round: this mode's step against mlx-lm's in the same round
                cell["ratio_runs"] = h.paired_ratios(r["step_s"], ref["step_s"])
            out[mode] = cell
        return out


def _sides(case: Case, modes: list[str], long: bool, with_mlx_lm: bool) -> dict:
    kv = {f"kvbatch_{m}": (lambda m=m: case.kvbatch(m, case.new)) for m in modes}
    if not with_mlx_lm:
        return kv
    ref = {"mlx_lm": lambda: case.mlx_lm(case.new)}
    return {**kv, **ref} if long else {**ref, **kv}  # kvbatch first at long context


def _compare(row: dict, case: Case, modes: list[str], bw: float | None) -> None:
    """Ratios to mlx-lm, KV held against needed, same tokens, roofline: into row's kvbatch cells."""
    base = row.get("mlx_lm", {})
    ref_out = base.pop("outputs", None)
    for m in modes:
        v = row[f"kvbatch_{m}"]
        out = v.pop("outputs", None)
        if not v.get("decode_tps"):
            continue
        if base.get("decode_tps"):
            v["ratio_vs_mlx_lm"] = v["decode_tps"] / base["decode_tps"]
            runs_a, runs_b = v.get("decode_tps_runs", []), base.get("decode_tps_runs", [])
            if len(runs_a) == len(runs_b) > 1:
                v["ratio_runs"] = [x / y if x and y else None for x, y in zip(runs_a, runs_b)]
        if base.get("e2e_tps") and v.get("e2e_tps"):  # the whole generate call (prefill included), medians
            v["e2e_ratio_vs_mlx_lm"] = v["e2e_tps"] / base["e2e_tps"]
        if ref_out is not None and out is not None:
            v["rows_same_tokens"] = f"{sum(x == y for x, y in zip(out, ref_out))}/{case.batch}"
        if "kv_held" in v:
            needed = case.batch * (case.plen + case.new - 1) * v["kv_bytes_per_token"]
            v.update(kv_needed=needed, kv_target_met=v["kv_held"] <= needed + case.batch * v["page_bytes"])
        if bw:
            ctx = case.plen + case.new // 2
            dense = h.kv_bytes_per_token(case.spec, "none", case.a.page_size)
            own = h.kv_bytes_per_token(case.spec, m, case.a.page_size)
            row["roofline_tps"] = case.batch * bw / (case.spec.weights_bytes + case.batch * ctx * dense)
            v["roofline_fraction"] = v["decode_tps"] / row["roofline_tps"]
            v["roofline_fraction_mode"] = v["decode_tps"] * (case.spec.weights_bytes + case.batch * ctx * own) / (
                case.batch * bw)


def run_case(m, a, batch: int, plen: int, new: int, modes: list[str], long: bool, bw: float | None) -> dict:
    case = Case(m, a, batch, plen, new)
    with_mlx_lm = not a.no_mlx_lm and not (long and a.skip_mlx_lm_long)
    interleaved = long and a.interleave > 0
    warm = warm_tokens(plen, new, a.page_size)
    row: dict = {"model": case.spec.name, "batch": batch, "prompt": plen, "new": new, "warmup_tokens": warm}
    # warm-up, not measured: kvbatch past its first page sealed in decode and the first split-K launch, so no
    # kernel variant compiles inside the measured runs (interleaved engines warm up inside their run)
    for mode in ([] if interleaved else modes):
        h.guarded(lambda: case.kvbatch(mode, warm))
    if with_mlx_lm and not interleaved:
        h.guarded(lambda: case.mlx_lm(warm))
    sides = {} if interleaved else _sides(case, modes, long, with_mlx_lm)
    if interleaved:
        got = h.guarded(lambda: case.interleaved(modes, with_mlx_lm))
        for m in modes:  # a failed run: its error in every mode's cell
            row[f"kvbatch_{m}"] = dict(got.get(m, got))
        if with_mlx_lm:
            row["mlx_lm"] = dict(got.get("mlx_lm", got))
    for side, runs in h.alternate(sides, a.rounds, after=mx.clear_cache).items():
        row[side] = h.median_run(runs)
    if with_mlx_lm is False and not a.no_mlx_lm:
        row["mlx_lm"] = {"error": "skipped (--skip-mlx-lm-long)"}
    _compare(row, case, modes, bw)
    print(json.dumps(row), flush=True)
    return row


def run(a) -> dict:
    if a.cache_limit_gib and mx.default_device() == mx.cpu:
        mx.set_cache_limit(int(a.cache_limit_gib * (1 << 30)))
    bw = copy_bandwidth(a.bw_mib) if a.roofline else None
    modes = [m for m in a.modes.split(",") if m]
    long_modes = [m for m in (a.long_modes or a.modes).split(",") if m]
    for m in set(modes + long_modes):
        h.parse_mode(m)  # fail early on a bad mode
    out: dict = {"copy_bw_gbs": bw and bw / 1e9, "rows": []}
    for name in a.models.split(","):
        m = h.load(name)
        out.setdefault("weights_gb", {})[name] = m[2].weights_bytes / 1e9
        cases = [(b, a.prompt, a.new, modes, False) for b in map(int, filter(None, a.batches.split(",")))]
        cases += [(b, a.long, a.long_new, long_modes, True)
                  for b in map(int, filter(None, a.long_batches.split(","))) if a.long]
        for batch, plen, new, ms, long in cases:
            out["rows"].append(run_case(m, a, batch, plen, new, ms, long, bw))
            h.checkpoint(out)  # after every case: a run cut short keeps what ran
            mx.clear_cache()
    return out
