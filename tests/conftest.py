"""Shared pytest fixtures, and what the tests expect on the MLX backend they run on.

`import kvbatch.engine` comes first: it loads OpenBLAS before anything imports mlx
(loading it later has no effect, see engine/blas.py).

MLX_ENABLE_TF32=0 (read by MLX 0.32's CUDA backend; no effect on the CPU): float32
matmuls in full float32, not TF32. The tests compare the batched, paged engine with
mlx-lm's single-stream path on float32 models; with TF32 the model's own projections
(other shapes, other cuBLAS kernels on each side) differ by ~1e-3 before attention is
reached, which would hide what kvbatch adds. With it off, the 1e-4 bounds hold on CUDA
as on the CPU (the engine in production keeps MLX's default).
"""
from __future__ import annotations

import os

os.environ.setdefault("MLX_ENABLE_TF32", "0")
# OpenBLAS (read when kvbatch.engine loads it, below): a pytest-xdist worker's share of the cores. OpenBLAS
# starts a thread a core in every process, and its idle threads spin on the cores the other worker (and anything
# else on the machine) needs: on a busy machine a test ran several times slower (benchmarks/notebook, session W).
if "PYTEST_XDIST_WORKER" in os.environ:  # a worker; the controlling process runs no test
    _share = (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(max(1, _share)))

import shutil  # noqa: E402

import kvbatch.engine  # noqa: E402,F401  (must precede any mlx import)
import mlx.core as mx  # noqa: E402
import pytest  # noqa: E402

from kvbatch.engine.backend import backend  # noqa: E402
from kvbatch.engine.config import KV_BITS  # noqa: E402
from kvbatch.engine.hooks import EngineHooks  # noqa: E402
from kvbatch.engine.kv.routes import cuda_kernels  # noqa: E402
from kvbatch.engine.kv.routes.cuda import ROUTE_CUDA, ROUTE_CUDA_Q  # noqa: E402
from kvbatch.engine.kv.routes.dense import ROUTE_DENSE, ROUTE_DENSE_F32  # noqa: E402
from kvbatch.engine.kv.routes.quant import ROUTE_QMM  # noqa: E402
from kvbatch.engine.models.config import ModelConfig  # noqa: E402
from kvbatch.engine.models.load import load_model  # noqa: E402
from kvbatch.engine.testing import engine_config  # noqa: E402,F401  (also importable from here)

def pytest_addoption(parser):
    """--answer-tokens N: the length of the long answer in tests/engine/test_portable_route.py's flat-graph test
    (its default keeps the suite short; 30000 is the length a Mac's buffer limit is met at)."""
    parser.addoption("--answer-tokens", type=int, default=0, help="long-answer length of the flat-graph test")


ON_CPU = not mx.metal.is_available() and not mx.cuda.is_available()
ON_CUDA = mx.cuda.is_available()
cpu_only = pytest.mark.skipif(not ON_CPU, reason="tests a CPU-backend behaviour")


def expected_route(spec, mode: str, group_size: int = 64, route: str = "auto") -> str:
    """The attention route the engine must report for this model and KV mode on this backend:
    MLX CUDA runs decode in the fused kernels of engine/kv/routes/cuda_kernels.py wherever they handle
    the geometry (unless the options ask for the portable route); elsewhere SDPA over gathered pages
    (float32 SDPA for fp16 models) and quantized matmuls for q8/q4."""
    bits = KV_BITS[mode] if mode in KV_BITS else None
    bits = None if bits is None or bits[0] is None else bits
    rep = max(spec.num_heads // spec.num_kv_heads, 1)
    if route == "auto" and backend().cuda_kernels and \
            cuda_kernels.supports(spec.head_dim, rep, bits, group_size if bits else None):
        return ROUTE_CUDA_Q if bits else ROUTE_CUDA
    if bits:
        return ROUTE_QMM
    return ROUTE_DENSE_F32 if spec.dtype == "float16" else ROUTE_DENSE


def kv_cache(eng):
    """The engine's paged KV cache, for the tests of the cache itself (its store's pages and buffers, its
    attention route, its pass checks): the one place a test reaches past Engine.stats() and EngineHooks."""
    return eng.cache


MODEL_CACHE = "kvbatch-models"


def _shared_root(basetemp):
    """The run's temporary root: pytest-xdist gives each worker <root>/gwN (so the workers of one
    run share <root>); a single process has its own basetemp."""
    return basetemp.parent if os.environ.get("PYTEST_XDIST_WORKER") else basetemp


@pytest.fixture(scope="session")
def model_cache_dir(tmp_path_factory):
    """The run's model cache dir (converted/built models, built once per run: the xdist workers share
    it, engine/models/materialize.py's file lock lets one build while the other waits), removed when
    the run ends (pytest_sessionfinish below)."""
    d = _shared_root(tmp_path_factory.getbasetemp()) / MODEL_CACHE
    d.mkdir(exist_ok=True)
    return d


def pytest_sessionfinish(session):
    """The run is over when the controller (or the single process) finishes: drop the model cache
    (SmolLM2 alone is ~0.5 GB; pytest keeps its last basetemps)."""
    factory = getattr(session.config, "_tmp_path_factory", None)
    if factory is not None and not os.environ.get("PYTEST_XDIST_WORKER"):
        shutil.rmtree(_shared_root(factory.getbasetemp()) / MODEL_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def smollm2_config(model_cache_dir) -> ModelConfig:
    """ModelConfig of the default SmolLM2 model (float32 on CPU), cached in `model_cache_dir`."""
    return ModelConfig(source="smollm2", cache_dir=str(model_cache_dir))


@pytest.fixture(scope="session")
def smollm2(smollm2_config):
    """(model, tokenizer, spec) of SmolLM2-135M-Instruct, converted once per session."""
    return load_model(smollm2_config)


@pytest.fixture(scope="session")
def tiny_model(model_cache_dir):
    """Factory: tiny_model(**ModelConfig overrides) -> (model, tokenizer, spec).

    Seeded random llama/qwen3 (default: llama, 2 layers, 4 heads, 2 KV heads,
    head_dim 64, vocab 300, float32). Byte tokenizer: ids 0-255 are bytes,
    256 <|im_start|>, 257 <|im_end|> (eos), 258 <|endoftext|>. Same
    overrides -> the same loaded objects (cached for the session).
    """
    loaded: dict = {}

    def make(**overrides):
        key = tuple(sorted(overrides.items()))
        if key not in loaded:
            fields = {"source": "tiny", "name": "tiny", "cache_dir": str(model_cache_dir), **overrides}
            cfg = ModelConfig(**fields)
            loaded[key] = load_model(cfg)
        return loaded[key]

    return make



@pytest.fixture(scope="session")
def pg_server():
    """A real PostgreSQL server for the session (tests/pg_server.py); skipped only where no PostgreSQL
    server binaries are installed (`make system-deps` installs them on Debian/Ubuntu)."""
    from tests.pg_server import PgServer, find_bindir

    bindir = find_bindir()
    if bindir is None:
        pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl): apt-get install postgresql "
                    "(make system-deps does), or brew install postgresql")
    server = PgServer(bindir).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def pg_url(pg_server) -> str:
    """queue.url of a database for the tests' jobs (each test uses its own job ids in it)."""
    return pg_server.create_database("kvbatch_tests")


class PlanRecorder(EngineHooks):
    """Keeps every step's plan (admitted, refused, preempted, prefill chunks, decode rows)."""

    def __init__(self):
        super().__init__()
        self.plans = []

    def on_step(self, plan, times):
        self.plans.append(plan)

    def keys(self, kind: str) -> list[str]:
        """The row keys of every step's `kind` (admitted, refused, prefill or decode), in order."""
        rows = [getattr(x, "row", x) for p in self.plans for x in getattr(p, kind)]
        return [r.req.key for r in rows]


class ManualClock:
    """A clock for Queue(clock=...) that moves only when told: leases expire by `advance`, never by
    sleeping, so a test of lease timing holds however loaded the machine is."""

    def __init__(self, start: float | None = None):
        import time

        self.t = float(int(time.time())) if start is None else start  # whole seconds: exact sums

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


@pytest.fixture(params=["sqlite", "postgresql"])
def queue_backend(request, tmp_path):
    """Factory: queue_backend(name="q", clock=None) -> a new, empty Queue on this test's backend: a
    SQLite file under tmp_path, or a job of its own in the session's PostgreSQL database (same name,
    same queue: another connection to it). `clock` (a ManualClock) replaces the store's clock.
    `.kind` is the backend's name."""
    import uuid

    from kvbatch.pipeline.queue import Queue, open_store

    url = request.getfixturevalue("pg_url") if request.param == "postgresql" else ""
    run = uuid.uuid4().hex[:8]
    opened: list = []

    def make(name: str = "q", clock=None) -> Queue:
        folder = tmp_path / name
        q = Queue(open_store(url, folder, f"{request.node.name}-{run}-{name}"), clock)
        opened.append(q)
        return q

    make.kind = request.param
    make.url = url
    yield make
    for q in opened:
        try:
            q.close()
        except Exception:  # noqa: BLE001 - already closed by the test
            pass
