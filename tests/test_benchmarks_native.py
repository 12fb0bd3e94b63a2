"""The peers section (``pagedcore bench --only peers``): the Engine vs CTranslate2 on the same Llama converted with
CTranslate2's converter. Skipped cleanly, with its reason, where ctranslate2 is not installed or the run is not CPU
float32; where it is installed, the converted model's greedy tokens equal transformers', the worker really runs
under the malloc settings it is given, and a differing peer is named in the equality check.

Nothing here asserts on timings. The conversions and worker processes cost seconds each, so the workloads run here
are one or two of the quick ones; the whole quick section is marked slow.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from bench_helpers import ctx, wrong_tokens

from pagedcore.benchmarks import BenchOptions, common, ct2, native, run_benchmarks
from pagedcore.benchmarks.context import BenchContext
from pagedcore.benchmarks.native import CT2_DEFAULT, CT2_INT8, CT2_TUNED, PEERS
from pagedcore.benchmarks.peers import ENGINE, Batch, CTranslate2Peer, EnginePeer, EngineSession, PaddedBatch
from pagedcore.benchmarks.runner import Runner
from pagedcore.extras import install_hint

MISSING = f"ctranslate2 is not installed ({install_hint('bench')})"

pytestmark = pytest.mark.usefixtures("one_thread")
needs_ct2 = pytest.mark.skipif(ct2.missing() is not None, reason="ctranslate2 is not installed")


@pytest.fixture(scope="module")
def tiny():
    return common.bench_model(size="tiny")


@pytest.fixture(scope="module")
def converted(tiny, tmp_path_factory):
    if ct2.missing() is not None:
        pytest.skip("ctranslate2 is not installed")
    return ct2.convert_model(tiny, tmp_path_factory.mktemp("ct2"))


# ---------------------------------------------------------------------------------------------------- skipping
def test_missing_names_the_package_and_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ctranslate2" else real(name, *a))
    assert ct2.missing() == MISSING


def test_section_is_skipped_with_the_reason_without_ctranslate2(tiny, monkeypatch, tmp_path):
    monkeypatch.setattr(ct2, "missing", lambda: MISSING)
    result = native.run(ctx(tiny))
    assert result.skipped == MISSING
    assert result.rows == []
    text = result.markdown()
    assert "### 10. The native CPU engine: Engine vs CTranslate2 (quick workload)" in text
    assert f"Skipped: {MISSING}." in text


def test_bench_only_peers_without_ctranslate2_exits_0_and_reports_the_skip(monkeypatch, tmp_path):
    from pagedcore.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ctranslate2" else real(name, *a))
    argv = ["bench", "--quick", "--no-progress", "--model-size", "tiny", "--only", "peers", "--out", str(tmp_path)]
    assert main(argv) == 0
    text = (tmp_path / "results.md").read_text()
    assert f"Skipped: {MISSING}." in text


@pytest.mark.slow
def test_bench_only_peers_without_ctranslate2_in_a_child_process(tmp_path):
    # a child process where `import ctranslate2` finds nothing: the whole command, as a user without it runs it
    code = (
        "import importlib.util, sys; real = importlib.util.find_spec;"
        "importlib.util.find_spec = lambda n, *a: None if n == 'ctranslate2' else real(n, *a);"
        "from pagedcore.cli import main;"
        f"sys.exit(main(['bench', '--quick', '--no-progress', '--model-size', 'tiny', '--only', 'peers', "
        f"'--out', {str(tmp_path)!r}]))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Skipped: ctranslate2 is not installed" in (tmp_path / "results.md").read_text()


def test_section_is_skipped_off_cpu_float32(tiny):
    result = native.run(BenchContext(BenchOptions(quick=True, progress=False, dtype="bfloat16", model_size="tiny")))
    assert result.skipped == "the native CPU engine is compared on the CPU in float32; this run is on cpu in bfloat16"


# ---------------------------------------------------------------------------------------------------- the worker
def test_worker_env_sets_or_clears_the_malloc_tuning(monkeypatch):
    monkeypatch.setenv("MALLOC_ARENA_MAX_", "2")
    tuned, default = ct2.worker_env(ct2.TUNED_MALLOC), ct2.worker_env(None)
    assert {k: tuned[k] for k in ct2.TUNED_MALLOC} == ct2.TUNED_MALLOC and "MALLOC_ARENA_MAX_" not in tuned
    assert not [k for k in default if k.startswith("MALLOC_") and k.endswith("_")]


@needs_ct2
def test_converted_model_generates_transformers_greedy_tokens_under_either_malloc(tiny, converted):
    batch = Batch([[5, 6, 7, 8, 9], [10, 11, 12, 13, 14]], [6, 3])
    reference = PaddedBatch().serve(tiny, batch).tokens
    for malloc in (ct2.TUNED_MALLOC, None):
        with ct2.Worker(converted, "float32", threads=1, malloc=malloc) as worker:
            assert worker.malloc == (malloc or {})  # what the worker's own environment holds
            reply = worker.generate(batch.prompts, batch.new_tokens)
        assert reply.tokens == reference
        assert all(0 < f <= last <= reply.seconds for f, last in zip(reply.first, reply.last))


@needs_ct2
def test_static_prompt_serve_equals_the_full_prompts(tiny, converted):
    shared = [20, 21, 22, 23, 24, 25, 26, 27]
    batch = Batch([[*shared, 30, 31], [*shared, 40, 41, 42]], [4, 4])
    reference = PaddedBatch().serve(tiny, Batch([batch.prompts[0]], [4])).tokens
    reference += PaddedBatch().serve(tiny, Batch([batch.prompts[1]], [4])).tokens
    peer = CTranslate2Peer(converted, threads=1)
    assert peer.shared_prefix(batch) == len(shared)
    with peer.session(tiny) as serve:
        served = serve(batch)
        again = serve(batch)  # the cached static prompt, reused
    assert served.tokens == again.tokens == reference
    assert "static_prompt: the 8 shared tokens" in served.note and "MALLOC_TOP_PAD_=1000000000" in served.note


@needs_ct2
def test_a_worker_error_is_its_reply_and_a_dead_worker_is_named(converted):
    with ct2.Worker(converted, "float32", threads=1, malloc=None) as worker:
        with pytest.raises(RuntimeError, match="CTranslate2: "):
            worker.generate([[5, 6]], [])  # max(new_tokens) of nothing: the worker answers with the error
        assert len(worker.generate([[5, 6]], [2]).tokens[0]) == 2  # and keeps serving
    with pytest.raises(RuntimeError, match="the CTranslate2 worker exited"):
        ct2.Worker(converted, "no-such-type", threads=1, malloc=None)


# ---------------------------------------------------------------------------------------------------- the section
def one_thread_ctx(model) -> BenchContext:
    """The quick section on ``model`` with one thread each: two threads on a loaded test machine oversubscribe it."""
    return BenchContext(BenchOptions(quick=True, progress=False, threads=1), model)


def _only(monkeypatch, *indices):
    real = native.workloads
    monkeypatch.setattr(native, "workloads", lambda *a: [real(*a)[i] for i in indices])


@needs_ct2
def test_section_checks_equality_first_and_names_a_peer_whose_tokens_differ(tiny, converted, monkeypatch):
    _only(monkeypatch, 0, 3)  # batch 1 (latency too) and the shared prefix (static_prompt)
    monkeypatch.setattr(ct2, "convert_model", lambda model, root: converted)  # converted once, by the fixture
    real = CTranslate2Peer.serve

    def differs(self, worker, batch):
        served = real(self, worker, batch)
        if self.name == CT2_DEFAULT and batch.size > 1 and max(batch.new_tokens) > 2:  # timed runs, not warm-ups
            served.tokens = [wrong_tokens(t) if i == 2 else t for i, t in enumerate(served.tokens)]
        return served

    monkeypatch.setattr(CTranslate2Peer, "serve", differs)
    result = native.run(one_thread_ctx(tiny), repeats=1)
    assert result.skipped is None and len(result.rows) == 2
    for row in result.rows:
        assert set(row.runs) == set(PEERS)
        assert all(row.runs[name].error is None for name in PEERS), {n: row.runs[n].error for n in PEERS}
        assert row.runs[ENGINE].differ is None and row.runs[CT2_TUNED].differ is None  # transformers' tokens
        assert all(row.ratio(name) is not None for name in (CT2_TUNED, CT2_DEFAULT, CT2_INT8))
    assert result.rows[0].runs[CT2_DEFAULT].differ is None
    assert result.rows[1].runs[CT2_DEFAULT].differ == "differ in 1 of 1 runs: request 2 from token 0"
    text = result.markdown()
    assert text.index("**Equality check**") < text.index("**Generated tokens/s**")
    assert "| batch 1, 32-token prompt + 16 new | reference | identical | identical | identical |" in text
    assert "**differ in 1 of 1 runs: request 2 from token 0**" in text
    assert f"the greedy tokens of {CT2_DEFAULT} differ from transformers'" in text
    assert "Engine / CTranslate2 fp32 (tuned malloc), tokens/s: 8 x (64 shared + 8 unique), 8 new" in text
    assert "static_prompt: the 64 shared tokens" in text and "**Latency** of one request" in text


def test_the_engine_is_kept_for_the_workload_and_meets_each_round_with_no_cached_prefix(tiny, monkeypatch):
    """One Engine per workload, warmed on the workload itself, its cached prefixes forgotten before each round: a
    new Engine per round timed its first steps' trials (and, compiled, the compiler) in every round."""
    built = []
    real_engine = EnginePeer.engine
    monkeypatch.setattr(EnginePeer, "engine", lambda self, model: built.append(1) or real_engine(self, model))
    served = []
    real_serve = EngineSession.serve
    monkeypatch.setattr(EngineSession, "serve", lambda self, batch: served.append(real_serve(self, batch)) or
                        served[-1])  # fmt: skip
    w = native.workloads(True, tiny.config.vocab_size)[3]  # 8 x (64 shared + 8 unique): prefix hits if not forgotten
    peers = {ENGINE: EnginePeer(num_blocks=128, max_seqs=8), "padded": PaddedBatch()}
    with Runner(one_thread_ctx(tiny), "peers", 20) as runner:
        row = native._measure(runner, tiny, peers, w, repeats=2)
    assert built == [1] and row.runs[ENGINE].error is None and row.runs[ENGINE].differ is None
    assert len(row.runs[ENGINE].seconds) == 2 and len(row.runs["padded"].seconds) == 2
    prompt = sum(len(p) for p in w.batch.prompts)
    shared = 64 * (w.batch.size - 1)  # the 64-token prefix, computed once within a batch
    # the warm-up on the workload, then per round the warm batch and the timed batch, each computing its prompts
    assert [s.prefill for s in served][::2] == [prompt - shared] * 3
    assert [s.prefill for s in served][1::2] == [sum(len(p) for p in w.warm.prompts) - shared] * 2


@needs_ct2
@pytest.mark.slow
def test_bench_only_peers_quick_run(tmp_path):
    run_benchmarks(BenchOptions(quick=True, progress=False, model_size="tiny", threads=1, only=("peers",)), tmp_path)
    text = (tmp_path / "results.md").read_text()
    rows = [line for line in text.splitlines() if "| reference |" in line]
    assert len(rows) == 5 and all("| reference | identical | identical | identical |" in line for line in rows)
    assert text.count("| Engine / CTranslate2 fp32 (tuned malloc), tokens/s:") == 4
