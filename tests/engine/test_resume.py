"""Rows continued from checkpoints (engine/resume.py): an engine stopped at any step boundary, its rows'
checkpoints taken and admitted into a fresh engine, gives the tokens (and logprobs) of a run never stopped."""
from __future__ import annotations

import kvbatch.engine  # noqa: F401  (OpenBLAS before mlx)
import pytest

from kvbatch.engine.engine import Engine
from kvbatch.engine.kv.offload import KVFile
from kvbatch.engine.params import SamplingParams
from kvbatch.engine.resume import CheckpointRefused, RowCheckpoint
from kvbatch.engine.samples import samples
from kvbatch.engine.testing import engine_config
from kvbatch.engine.types import Request
from tests.engine.test_engine_paged import prompts_of
from tests.engine.test_speculative import NGRAM
from tests.engine.test_speculative import prompts as repetitive_prompts

STEPS = 60
SAMPLED = SamplingParams(max_tokens=STEPS, temperature=0.8, top_p=0.9, repetition_penalty=1.1,
                         presence_penalty=0.3, frequency_penalty=0.2, seed=11, logprobs=2, ignore_eos=True)
GREEDY = SamplingParams(max_tokens=STEPS, ignore_eos=True)


def _requests(params: SamplingParams) -> list[Request]:
    reqs = [Request(f"r{i}", p, params) for i, p in enumerate(prompts_of([7, 19, 3], salt=5))]
    if params.temperature:  # n=2 samples of one prompt: forked on a first run, resumed each on its own
        reqs += samples(Request("s", prompts_of([11], salt=9)[0], params), 2)
    return reqs


# test name -> (kv.mode, more KVConfig fields)
KV_MODES = {"none": ("none", None), "q8": ("q8", None), "q4": ("q4", None),
            "q4+rot+fp40": ("q4", {"rotate_keys": True, "full_precision_tokens": 40})}


def _engine(m, mode: str, speculative=None) -> Engine:
    model, tok, spec = m
    kv_mode, kv = KV_MODES[mode]
    return Engine(model, tok, spec, engine_config(kv_mode=kv_mode, kv=kv, page_size=16, max_batch=8,
                                                  prefill_chunk=16, speculative=speculative))


def _stopped_and_resumed(m, mode: str, reqs: list[Request], stops: list[int], speculative=None) -> dict:
    """Run, stopping after each engine has generated `stops[i]` tokens: checkpoints taken, a new engine continues."""
    done, kept = {}, {}
    for stop in [*stops, None]:
        eng = _engine(m, mode, speculative)
        for r in reqs:
            if r.key not in done:
                eng.add(r, checkpoint=kept.get(r.key))
        while eng.has_unfinished() and (stop is None or eng.generated_tokens < stop):
            done.update((res.key, res) for res in eng.step())
        if stop is not None:
            kept = eng.checkpoints()
            assert kept, "some rows were in flight at the stop"
            eng.cancel()
            done.update((res.key, res) for res in eng.step())  # results that finished with the last step
    return done


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
def test_rows_stopped_three_times_continue_to_the_uninterrupted_tokens(tiny_model, params):
    m = tiny_model()
    reqs = _requests(params)
    ref = {r.key: r for r in _engine(m, "none").generate(reqs)}
    got = _stopped_and_resumed(m, "none", reqs, [25, 45, 40])
    assert set(got) == set(ref)
    for k, r in ref.items():
        assert got[k].tokens == r.tokens and len(r.tokens) == STEPS, k
        assert got[k].ok and got[k].finish_reason == "length"
        if params.logprobs:
            assert got[k].logprobs is not None and r.logprobs is not None
            assert got[k].logprobs.tokens == pytest.approx(r.logprobs.tokens, abs=1e-4)
            ids = [[[t for t, _ in top] for top in x.logprobs.top] for x in (got[k], r)]
            assert ids[0] == ids[1]
    resumed = [got[k].stats.resumed_tokens for k in ref]
    assert all(0 <= n < STEPS for n in resumed) and sum(resumed) > 0


@pytest.mark.parametrize("mode", ["q8", "q4"])
def test_quantized_kv_greedy_rows_continue_to_the_uninterrupted_tokens(tiny_model, mode):
    """A resumed row prefills its kept tokens; decode read them from sealed (quantized) pages. On the test
    model the greedy tokens are the same (the preemption tests bound the logits' difference)."""
    m = tiny_model()
    reqs = _requests(GREEDY)
    ref = {r.key: r.tokens for r in _engine(m, mode).generate(reqs)}
    got = _stopped_and_resumed(m, mode, reqs, [40])
    assert {k: r.tokens for k, r in got.items()} == ref


def test_a_checkpoint_that_cannot_continue_is_refused(tiny_model):
    m = tiny_model()
    eng = _engine(m, "none")
    req = _requests(GREEDY)[0]
    for bad in (RowCheckpoint([]), RowCheckpoint([1] * STEPS), RowCheckpoint([100_000]),
                RowCheckpoint([1, 2])):
        p = req if bad.tokens != [1, 2] else Request("lp", req.prompt_tokens, SamplingParams(max_tokens=8, logprobs=1))
        with pytest.raises(CheckpointRefused):
            eng.add(p, checkpoint=bad)
    assert not eng.has_unfinished()


@pytest.mark.smollm2
def test_smollm2_chat_rows_stopped_mid_answer_continue_to_the_uninterrupted_tokens(smollm2):
    model, tok, spec = smollm2
    qs = ["Write a long story about a lighthouse keeper.", "Explain how a bicycle works."]
    reqs = [Request(f"q{i}", tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True),
                    SamplingParams(max_tokens=16)) for i, q in enumerate(qs)]
    ref = {r.key: r.tokens for r in _engine(smollm2, "none").generate(reqs)}
    got = _stopped_and_resumed(smollm2, "none", reqs, [12])
    assert {k: r.tokens for k, r in got.items()} == ref
    assert any(r.stats.resumed_tokens for r in got.values())


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(max_tokens=STEPS, temperature=1.0, top_k=2, seed=11,
                                                           ignore_eos=True)], ids=["greedy", "seeded"])
def test_speculating_rows_stopped_continue_to_the_tokens_without_speculation(tiny_model, params):
    """Checkpoints of rows decoding with n-gram speculation hold accepted tokens only: stopped twice and continued
    (speculating again), the rows end with the tokens of a run without speculation, never stopped."""
    m = tiny_model()
    reqs = [Request(f"r{i}", p, params) for i, p in enumerate(repetitive_prompts(4))]
    ref = {r.key: r.tokens for r in _engine(m, "none").generate(reqs)}
    got = _stopped_and_resumed(m, "none", reqs, [30, 50], speculative=NGRAM)
    assert {k: r.tokens for k, r in got.items()} == ref
    assert sum(r.stats.spec_accepted for r in got.values()) > 0  # proposals were accepted, before and after stops
    assert sum(r.stats.resumed_tokens for r in got.values()) > 0


def _stopped_keeping_kv(m, mode: str, reqs: list[Request], stop: int, folder, spoil=None, resume_mode=None,
                        early: int = 0):
    """Run until `stop` tokens, checkpoint and keep the rows' K/V pages in files, then continue in a fresh
    engine (of `resume_mode`) from both; spoil(files) damages files in between; early: the checkpoints are
    taken at this many tokens instead (the files then hold pages beyond them). (results, tokens saved by
    key, checkpoints, the second engine's stats)."""
    eng = _engine(m, mode)
    for r in reqs:
        eng.add(r)
    done, kept = {}, {}
    while eng.generated_tokens < stop:
        done.update((res.key, res) for res in eng.step())
        if early and not kept and eng.generated_tokens >= early:
            kept = eng.checkpoints()
    kept = {k: ck for k, ck in (kept or eng.checkpoints()).items() if k not in done}
    files = {k: KVFile(str(folder / f"{k}.safetensors"), "model-and-settings") for k in kept}
    saved = eng.save_kv(files)
    eng.cancel()
    done.update((res.key, res) for res in eng.step())
    if spoil:
        spoil(files)
    eng = _engine(m, resume_mode or mode)
    for r in reqs:
        if r.key not in done:
            eng.add(r, checkpoint=kept.get(r.key), kv_file=files.get(r.key))
    while eng.has_unfinished():
        done.update((res.key, res) for res in eng.step())
    return done, saved, kept, eng.stats()


@pytest.mark.parametrize("mode", ["none", "q8", "q4+rot+fp40"])
def test_rows_continue_from_their_kept_kv_pages_prefilling_only_the_rest(tiny_model, mode, tmp_path):
    """A row's full pages kept at the stop are loaded, not prefilled: the next engine prefills only what
    follows them (< one page plus the last token), and the tokens are an uninterrupted run's (q4 with rotated
    keys and its first 40 tokens dense: the packed pages, the rotation and the dense copy all come back)."""
    m = tiny_model()
    reqs = _requests(GREEDY)
    ref = {r.key: r.tokens for r in _engine(m, mode).generate(reqs)}
    got, saved, kept, stats = _stopped_keeping_kv(m, mode, reqs, 120, tmp_path)
    assert {k: r.tokens for k, r in got.items()} == ref
    assert set(saved) == set(kept) and all(n >= 16 and n % 16 == 0 for n in saved.values())
    assert stats["kv_restored_tokens"] == sum(saved.values()) > 0 and stats["kv_files_unused"] == 0
    rest = {k: len(reqs[i].prompt_tokens) + len(kept[k].tokens) - saved[k]
            for i, k in enumerate(r.key for r in reqs) if k in kept}
    assert all(1 <= n <= 16 for n in rest.values()), rest
    assert stats["prefill_tokens_total"] == sum(rest.values())


def test_kept_kv_that_does_not_hold_is_passed_over_and_its_row_prefills(tiny_model, tmp_path):
    """A corrupted, a truncated and a foreign file (another row's, whole): each is detected, its row prefills its
    kept tokens instead, and the tokens are still an uninterrupted run's; a file of another KV mode is
    never read; of a file holding pages beyond the row's checkpoint, the pages of its kept tokens are used."""
    m = tiny_model()
    reqs = _requests(GREEDY)
    ref = {r.key: r.tokens for r in _engine(m, "none").generate(reqs)}

    def spoil(files):
        a, b, c = (files[k].path for k in ("r0", "r1", "r2"))
        data = bytearray(open(a, "rb").read())
        open(c, "wb").write(bytes(data))  # r2's file is r0's: whole, its checksum holds, another row's tokens
        data[-100] ^= 0xFF  # one byte of r0's K/V
        open(a, "wb").write(bytes(data))
        open(b, "r+b").truncate(len(open(b, "rb").read()) // 2)

    got, saved, kept, stats = _stopped_keeping_kv(m, "none", reqs, 120, tmp_path, spoil)
    assert {k: r.tokens for k, r in got.items()} == ref
    assert stats["kv_restored_tokens"] == 0 and stats["kv_files_unused"] == 3
    rest = sum(len(r.prompt_tokens) + len(kept[r.key].tokens) for r in reqs if r.key in kept)
    assert stats["prefill_tokens_total"] == rest
    (tmp_path / "other").mkdir()
    got, saved, _, stats = _stopped_keeping_kv(m, "none", reqs, 120, tmp_path / "other", resume_mode="q8")
    assert stats["kv_restored_tokens"] == 0 and stats["kv_files_unused"] == len(saved) > 0
    (tmp_path / "early").mkdir()
    got, saved, kept, stats = _stopped_keeping_kv(m, "none", reqs, 120, tmp_path / "early", early=60)
    assert {k: r.tokens for k, r in got.items()} == ref
    prefix = {r.key: min(saved[r.key] // 16, (len(r.prompt_tokens) + len(kept[r.key].tokens) - 1) // 16) * 16
              for r in reqs if r.key in kept}
    assert sum(prefix.values()) < sum(saved.values()) and stats["kv_files_unused"] == 0
    assert stats["kv_restored_tokens"] == sum(prefix.values()) > 0
