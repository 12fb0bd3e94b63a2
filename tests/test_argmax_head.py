"""The greedy choice fused into the model's head (issue 33.3; pagedcore/adapters/transformers/argmax_head.py): steps
whose rows only take their argmax get their tokens from the head's input a vocabulary chunk at a time, and every
token is still stock ``generate``'s — across chunk boundaries and ties, padded batches of lengths, a weights update,
NaN logits; a model that changes its head's output, or a GEMM whose chunks sum in another order, keeps the logits.

The tiny models here have a 5000-token vocabulary, so that a step's head is projected in more than one chunk."""

from __future__ import annotations

import threading

import pytest
import torch
from family_configs import tiny_family
from transformers import DynamicCache

from pagedcore import ConfigError
from pagedcore.adapters.transformers import Engine, SamplingParams, argmax_head, head_screen
from pagedcore.adapters.transformers.argmax_head import ArgmaxCounts, ArgmaxHead, chunk_columns
from pagedcore.adapters.transformers.testing import tiny_llama
from pagedcore.engine.runner import ArgmaxTokens

pytestmark = pytest.mark.usefixtures("one_thread")

SCREENS = head_screen.available()  # fbgemm's float16 GEMM (x86): the third way, the screen
VOCAB = 5000
PROMPTS = [[5, 9, 30, 41, 7, 8, 100, 12], [77, 78, 79], [4000, 4999, 17, 3, 3, 3, 3, 3, 3, 3, 3, 250], [1]]
NEW = 8


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    built = tiny_llama(vocab_size=VOCAB)
    built.generation_config.eos_token_id = None  # every generation runs to its length
    built.generation_config.pad_token_id = 0
    return built


def stock(reference: torch.nn.Module, prompts: list[list[int]], new: int = NEW) -> list[list[int]]:
    out = []
    for prompt in prompts:
        ids = reference.generate(
            torch.tensor([prompt]), max_new_tokens=new, do_sample=False, cache=DynamicCache(config=reference.config)
        )
        out.append(ids[0, len(prompt) :].tolist())
    return out


def engine_of(net: torch.nn.Module) -> Engine:
    return Engine(net, num_blocks=128, block_size=4, max_num_batched_tokens=16)


def tokens(engine: Engine, prompts: list[list[int]], params: SamplingParams | None = None) -> list[list[int]]:
    outs = engine.generate(prompts, params or SamplingParams(max_new_tokens=NEW), use_tqdm=False)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [o.token_ids for o in outs]


def test_greedy_steps_take_the_fused_head_and_give_generates_tokens():
    net = model()
    want = stock(net, PROMPTS)
    with engine_of(net) as engine:
        head = engine.runner.argmax_head
        assert head is not None
        assert tokens(engine, PROMPTS[3:]) == want[3:]
        if SCREENS:  # one row: the screen reads half of the head's bytes, so one-row steps are tried too
            assert head.counts.steps > 0
        else:  # one row: the whole head (a matrix-vector product) is the faster
            assert head.counts == ArgmaxCounts()
        assert tokens(engine, PROMPTS) == want
        assert tokens(engine, PROMPTS[:2] * 3) == want[:2] * 3  # prefix hits, then six rows together
        assert head.counts.steps > 0 and head.counts.fallbacks == 0
        assert 0 < head.counts.whole < head.counts.steps  # a bucket's trials: every way gave generate's tokens
        assert (0 < head.counts.screened < head.counts.steps) == SCREENS
        n2 = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=NEW, n=2), use_tqdm=False)[0]
        assert [s.token_ids for s in n2.samples] == [want[0], want[0]]  # greedy samples fork on the same token
    assert "forward" not in vars(net.lm_head)  # closing the Engine gives the head its own forward back


def test_rows_that_read_the_logits_keep_the_logits_path():
    net = model()
    want = stock(net, PROMPTS[:2])
    with engine_of(net) as engine:
        head = engine.runner.argmax_head
        params = [SamplingParams(max_new_tokens=NEW), SamplingParams(max_new_tokens=NEW, logprobs=0)]
        outs = engine.generate(PROMPTS[:2], params, use_tqdm=False)
        assert [o.token_ids for o in outs] == want
        assert head.counts.steps == 0  # every step had a row asking for log-probabilities
        asking = ({"return_logits": True}, {"repetition_penalty": 1.1}, {"min_new_tokens": 2, "stop_token_ids": [3]})
        for asked in asking:
            tokens(engine, PROMPTS[:1], SamplingParams(max_new_tokens=2, **asked))
        assert head.counts.steps == 0


def test_ties_across_chunks_go_to_the_first_maximal_index():
    columns = chunk_columns(3)
    head_layer = torch.nn.Linear(4, 3 * columns + 5, bias=True)
    with torch.no_grad():
        head_layer.weight.zero_()
        head_layer.bias.fill_(0.5)  # the same everywhere: the ties stay
        head_layer.weight[[7, columns + 7, 2 * columns + 1], 0] = 1.0  # row 0: a tie of chunks 0, 1 and 2
        head_layer.weight[[columns + 3, 3 * columns + 4], 1] = 5.0  # row 1: a tie of chunks 1 and 3 (the last)
    x = torch.tensor([[[2.0, 0, 0, 0], [0.0, 1, 0, 0], [0.0, 0, 0, 0]]])  # row 2: every logit 0.5
    head = ArgmaxHead(head_layer)
    with torch.inference_mode():
        logits = head.step(lambda: head_layer(x)[0], 3)  # the check
        fused = head.step(lambda: head_layer(x)[0], 3)
    assert isinstance(logits, torch.Tensor) and isinstance(fused, ArgmaxTokens)
    assert fused.tokens == logits.argmax(-1).tolist() == [7, columns + 3, 0]
    head.close()


def test_nan_logits_give_the_samplers_answer():
    net = model()
    with engine_of(net) as engine:
        head = engine.runner.argmax_head
        with torch.no_grad():  # after the Engine's probe (which refuses a model whose logits are NaN)
            net.lm_head.weight[4321] = float("nan")  # every row's logit 4321 is NaN: numpy's and torch's maximum
        fused = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6), use_tqdm=False)
        assert head.counts.fallbacks > 0 and head.counts.steps == 0
        plain = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, logprobs=0), use_tqdm=False)
    assert [(o.token_ids, o.error) for o in fused] == [(o.token_ids, o.error) for o in plain]
    assert fused[0].token_ids[0] == 4321


def test_a_model_that_changes_its_heads_output_keeps_the_logits_path():
    net = tiny_family("gemma2", vocab_size=VOCAB)  # softcapped logits: tanh after the head
    assert net.config.final_logit_softcapping
    want = stock(net, PROMPTS[:2])
    with engine_of(net) as engine:
        assert tokens(engine, PROMPTS[:2]) == want
        head = engine.runner.argmax_head
        assert head is not None and head.counts.checks == 1 and head.counts.steps == 0


def test_chunks_whose_bits_differ_from_the_whole_gemm_keep_the_logits_path(monkeypatch):
    class Shifted:  # a BLAS that sums a narrower GEMM in another order: the chunks' last bits move
        @staticmethod
        def linear(x, weight, bias=None):
            out = torch.nn.functional.linear(x, weight, bias)
            return torch.nextafter(out, torch.full_like(out, float("inf"))) if weight.shape[0] < VOCAB else out

    monkeypatch.setattr(argmax_head, "F", Shifted)
    net = model()
    want = stock(net, PROMPTS)
    with engine_of(net) as engine:
        assert tokens(engine, PROMPTS) == want
        head = engine.runner.argmax_head
        assert head.counts.checks > 0 and head.counts.steps == 0


@pytest.mark.parametrize("where", ["head", "model", "global"])
def test_a_hook_that_changes_the_logits_after_the_check_is_applied_and_its_removal_too(where):
    """Regression: the check that the model returns its head's output untouched ran once, at the first greedy step;
    a forward hook added later on the head (or on the model, or a global one) was handed the chunked way's empty
    output and the Engine kept the tokens of the unhooked logits. The check runs again when the hooks around the
    head change: the hooked logits' tokens, then, with the hook removed, the fused way again."""
    net = model()
    with engine_of(net) as engine:
        head = engine.runner.argmax_head
        assert tokens(engine, PROMPTS) == stock(net, PROMPTS) and head.counts.steps > 0

        def flipped(module, args, out):
            if module is net and where == "model":
                out.logits = out.logits.flip(-1)
                return out
            return out.flip(-1) if module is net.lm_head and where != "model" else None

        if where == "global":
            handle = torch.nn.modules.module.register_module_forward_hook(flipped)
        else:
            handle = (net.lm_head if where == "head" else net).register_forward_hook(flipped)
        try:
            want = stock(net, PROMPTS)
            before = head.counts.steps
            assert tokens(engine, PROMPTS) == want
            assert head.counts.steps == before  # the hooked head keeps the logits path
        finally:
            handle.remove()
        assert tokens(engine, PROMPTS) == stock(net, PROMPTS) and head.counts.steps > before


def test_greedy_tokens_follow_a_weights_update():
    net, reference = model(), model()
    with engine_of(net) as engine:
        head = engine.runner.argmax_head
        assert tokens(engine, PROMPTS) == stock(reference, PROMPTS)
        before = head.counts.steps
        with torch.no_grad():  # e.g. an optimizer step: the head changes in place, the Engine sees it next step
            for layer in (net, reference):
                layer.lm_head.weight.mul_(-1.0)
        assert tokens(engine, PROMPTS) == stock(reference, PROMPTS)
        assert head.counts.steps > before


def test_a_replaced_head_is_freed_and_the_new_one_computes_the_tokens():
    """``model.lm_head = new``: the fused head held the old module (and its weight) until the Engine closed; it holds
    it weakly now. The new head's tokens are the model's own either way."""
    import gc
    import weakref

    net, reference = model(), model()
    with engine_of(net) as engine:
        assert tokens(engine, PROMPTS) == stock(reference, PROMPTS)
        assert engine.runner.argmax_head is not None and engine.runner.argmax_head.counts.steps > 0
        new = torch.nn.Linear(net.config.hidden_size, VOCAB, bias=False)
        with torch.no_grad():
            new.weight.copy_(net.lm_head.weight.flip(0))
        reference.lm_head = torch.nn.Linear(net.config.hidden_size, VOCAB, bias=False)
        reference.lm_head.load_state_dict(new.state_dict())
        old = weakref.ref(net.lm_head)
        net.lm_head = new
        gc.collect()
        assert old() is None
        assert tokens(engine, PROMPTS) == stock(reference, PROMPTS)


def test_other_threads_calls_of_the_head_are_plain_while_the_engine_steps():
    net = model()
    x = torch.randn(2, 3, net.config.hidden_size)
    # The reference is made in a thread of its own too: a new thread runs torch's default thread count (the
    # one_thread fixture sets this thread's), and on some CPUs (AMD EPYC, MKL) 1 and 2 threads give other bits.
    made: list[torch.Tensor] = []
    reference = threading.Thread(target=lambda: made.append(torch.nn.functional.linear(x, net.lm_head.weight)))
    reference.start()
    reference.join()
    want = made[0]
    seen: list[bool] = []
    stop = threading.Event()

    def other_user() -> None:
        while not stop.is_set():
            with torch.inference_mode():
                seen.append(torch.equal(net.lm_head(x), want))

    with engine_of(net) as engine:
        worker = threading.Thread(target=other_user)
        worker.start()
        try:
            tokens(engine, PROMPTS)
        finally:
            stop.set()
            worker.join()
        assert engine.runner.argmax_head.counts.steps > 0
    assert seen and all(seen)


def test_fused_argmax_false_keeps_the_logits_path_and_a_bad_value_is_refused():
    net = model()
    with Engine(net, num_blocks=64, block_size=4, fused_argmax=False) as engine:
        assert engine.runner.argmax_head is None
        forward = vars(net.lm_head).get("forward")  # the row split's (prepacked.py) with 2+ threads: no fused head
        assert forward is None or type(forward).__module__.endswith(".prepacked")
        assert tokens(engine, PROMPTS[:2]) == stock(model(), PROMPTS[:2])
    with pytest.raises(ConfigError, match="fused_argmax must be True or False, got 'yes'") as caught:
        Engine(net, num_blocks=64, block_size=4, fused_argmax="yes")
    assert caught.value.param == "fused_argmax"
    assert net.config._attn_implementation != "paged"  # refused before the model was touched


def test_a_forward_that_stops_calling_the_head_once_is_answered_by_the_logits_path():
    layer = torch.nn.Linear(8, 600)
    x = torch.randn(1, 2, 8)
    twice = [False]

    def forward() -> torch.Tensor:
        if twice[0]:
            layer(x)  # e.g. a draft head sharing the layer: the head's input is no longer the model's only one
        return layer(x)[0]

    head = ArgmaxHead(layer)
    with torch.inference_mode():
        assert isinstance(head.step(forward, 2), torch.Tensor)  # the checks
        assert isinstance(head.step(forward, 2), ArgmaxTokens)
        twice[0] = True
        logits = head.step(forward, 2)
        assert isinstance(logits, torch.Tensor) and torch.equal(logits, layer(x)[0])
        twice[0] = False
        assert isinstance(head.step(forward, 2), torch.Tensor)  # the logits path from then on
    head.close()


def test_the_heads_pass_runs_inside_the_models_forward(monkeypatch):
    # what times a model's forward (pagedcore bench's forward hooks, a profiler) times the head's pass with it
    net = model()
    inside = [False]
    seen: list[bool] = []
    net.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
    net.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    chunks = ArgmaxHead._argmax

    def watched(self, x):
        seen.append(inside[0])
        return chunks(self, x)

    monkeypatch.setattr(ArgmaxHead, "_argmax", watched)
    with engine_of(net) as engine:
        assert tokens(engine, PROMPTS) == stock(model(), PROMPTS)
        assert engine.runner.argmax_head.counts.steps > 0
    assert seen and all(seen)


def test_each_bucket_of_row_counts_keeps_the_way_its_own_steps_measured_faster(monkeypatch):
    # the chunks win where the whole logits overflow the caches, the whole GEMM where a large cache holds them
    # (docs/benchmarks.md): a clock driven by the test makes the chunks cost 5 per row at 2-3 rows, 1 at 4-7
    now = [0.0]
    cost = {"chunks": {2: 5.0, 4: 1.0}, "whole": {2: 2.0, 4: 2.0}}
    chunks, whole = ArgmaxHead._argmax, argmax_head._whole_argmax

    def charged(way, rows):
        now[0] += cost[way][1 << (rows.bit_length() - 1)] * rows

    def timed_chunks(self, x):
        charged("chunks", x.numel() // x.shape[-1])
        return chunks(self, x)

    def timed_whole(logits):
        charged("whole", logits.numel() // logits.shape[-1])
        return whole(logits)

    monkeypatch.setattr(argmax_head, "_clock", lambda: now[0])
    monkeypatch.setattr(ArgmaxHead, "_argmax", timed_chunks)
    monkeypatch.setattr(argmax_head, "_whole_argmax", timed_whole)
    layer = torch.nn.Linear(8, 3000)
    head = ArgmaxHead(layer)
    threads = torch.get_num_threads()
    with torch.inference_mode():
        for rows in (2, 5, 3):
            x = torch.randn(1, rows, 8)
            want = layer(x)[0].argmax(-1).tolist()
            got = [head.step(lambda x=x: layer(x)[0], rows) for _ in range(2 * argmax_head.TRIALS + 3)]
            assert isinstance(got[0], torch.Tensor)  # the row count's bit check
            assert all(isinstance(g, ArgmaxTokens) and g.tokens == want for g in got[1:])
    assert head.ways == {(2, threads): "whole", (4, threads): "chunks"}
    # 2 rows: 3 trials each way, then 2 steps whole; 5 rows: 3 each, then chunks; 3 rows: bucket 2, decided: whole
    assert head.counts == ArgmaxCounts(steps=3 * 8, whole=3 + 2 + 3 + 8, checks=3, fallbacks=0)
    head.close()


def test_a_forced_way_is_kept_and_a_bad_one_refused():
    layer = torch.nn.Linear(8, 3000)
    with torch.no_grad():
        layer.weight[1234] = float("nan")
    x = torch.randn(1, 4, 8)
    for way in ("chunks", "whole"):
        head = ArgmaxHead(layer, way=way)
        with torch.inference_mode():
            steps = [head.step(lambda: layer(x)[0], 4) for _ in range(3)]
        # every row's maximum is the NaN: each way hands the sampler the model's whole logits
        whole = layer(x)[0].view(torch.int32)
        assert all(isinstance(s, torch.Tensor) and torch.equal(s.view(torch.int32), whole) for s in steps)
        assert head.counts.fallbacks == 2 and head.counts.steps == 0 and not head.ways
        head.close()
    with pytest.raises(ValueError, match="way must be 'auto', 'chunks', 'whole' or 'screen', got 'fast'"):
        ArgmaxHead(layer, way="fast")
    with pytest.raises(ValueError, match=r"way='screen' needs a low-precision product .* and a head without bias"):
        ArgmaxHead(layer, way="screen")  # this layer has a bias
