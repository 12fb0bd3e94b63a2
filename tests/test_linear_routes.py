"""A linear layer's settled route (linear_routes.py): once the row split settled a shape on the kernel, the layer calls
it straight; whatever the route was made for that no longer holds sends the call the full way, with F.linear's bits."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from pagedcore.adapters.transformers.linear_routes import NO_ROUTE, PLAIN, Route
from pagedcore.adapters.transformers.prepacked import PrepackedLinears
from pagedcore.adapters.transformers.row_kernel import Order, RowKernel, load
from pagedcore.adapters.transformers.row_split import MAX_ROWS, TRIALS

needs_kernel = pytest.mark.skipif(load() is None, reason="no C compiler or no AVX2 on this machine")


@pytest.fixture
def layer(two_threads, kernel_wins) -> Iterator[tuple[torch.nn.Linear, PrepackedLinears, list[int]]]:
    """A bias layer whose 3-row calls settled on the kernel and made their route, its packs, and a count of the calls
    that went the full way (PrepackedLinears.linear) from then on."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    packs = PrepackedLinears(model, pack=False)
    linear = model[0]
    with torch.inference_mode(), packs.active():
        for _ in range(3 * TRIALS + 3):
            x = torch.randn(1, 3, 64)
            assert torch.equal(linear(x), F.linear(x, linear.weight, linear.bias))
    if packs.row_split.kernel_order((64, 64, True), 3, 2) is None:
        pytest.skip("the kernel's bits matched F.linear's at 3 rows nowhere on this CPU")
    route = vars(linear)["forward"]._routes[torch.Size([1, 3, 64])]
    assert route is not NO_ROUTE
    full: list[int] = []
    real = PrepackedLinears.linear

    def counted(self: PrepackedLinears, module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        full.append(1)
        return real(self, module, x)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PrepackedLinears, "linear", counted)
        yield linear, packs, full
    packs.close()


def stock(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, linear.weight, linear.bias)


@needs_kernel
def test_a_settled_shape_calls_the_kernel_straight_and_sees_in_place_updates(layer):
    linear, packs, full = layer
    with torch.inference_mode(), packs.active():
        x = torch.randn(1, 3, 64)
        assert torch.equal(linear(x), stock(linear, x))
        assert full == []  # the route, not the full way
        linear.weight.mul_(1.5)  # an optimizer step's in-place update: the route reads the weight as it is now
        linear.bias.add_(0.25)
        assert torch.equal(linear(x), stock(linear, x))
        assert full == []
        other = torch.randn(1, 5, 64)  # a row count with no route yet: the full way
        assert torch.equal(linear(other), stock(linear, other)) and full == [1]


@needs_kernel
@pytest.mark.parametrize(
    "change",
    ["new weight", "new bias", "no bias", "weight data turned", "input not contiguous", "threads", "autograd"],
)
def test_what_the_route_was_made_for_no_longer_holding_sends_the_call_the_full_way(layer, change):
    linear, packs, full = layer
    x = torch.randn(1, 3, 64)
    grad = False
    if change == "new weight":
        linear.weight = torch.nn.Parameter(torch.randn(64, 64))
    elif change == "new bias":
        linear.bias = torch.nn.Parameter(torch.randn(64))
    elif change == "no bias":
        linear.bias = None
    elif change == "weight data turned":  # the same Parameter, its data a transposed view: same shape, not contiguous
        linear.weight.data = torch.randn(64, 64).t()
    elif change == "input not contiguous":
        x = torch.randn(1, 64, 3).transpose(1, 2)
    elif change == "threads":
        torch.set_num_threads(1)
    else:
        grad = True
    with torch.inference_mode(not grad), torch.set_grad_enabled(grad), packs.active():
        assert x.shape == (1, 3, 64)
        out = linear(x)
        assert torch.equal(out, stock(linear, x))
    assert full == [1]
    assert out.requires_grad is grad


@needs_kernel
def test_a_replaced_weight_or_another_thread_count_gets_its_route_again(layer):
    """A replaced parameter (an RL loop's ``load_state_dict(assign=True)``) or ``torch.set_num_threads`` after the
    warm-up: one call the full way, then the route is made again where the row split has settled the new case."""
    linear, packs, full = layer
    x = torch.randn(1, 3, 64)
    linear.weight = torch.nn.Parameter(torch.randn(64, 64))
    with torch.inference_mode(), packs.active():
        for _ in range(3):
            assert torch.equal(linear(x), stock(linear, x))
    assert full == [1]  # the same shape and threads were settled: routed again from the second call
    torch.set_num_threads(1)
    with torch.inference_mode(), packs.active():
        for _ in range(3 * TRIALS + 3):  # one thread: the row split checks and times this shape anew
            assert torch.equal(linear(x), stock(linear, x))
        if packs.row_split.kernel_order((64, 64, True), 3, 1) is None:
            pytest.skip("the kernel's bits matched F.linear's at 3 rows and 1 thread nowhere on this CPU")
        calls = len(full)
        assert torch.equal(linear(x), stock(linear, x))
    assert len(full) == calls  # routed at one thread


@needs_kernel
def test_outside_the_runners_forward_the_layer_is_stock(layer):
    linear, _, full = layer
    x = torch.randn(1, 3, 64)
    with torch.inference_mode():
        assert torch.equal(linear(x), stock(linear, x))
    assert full == [1]


@needs_kernel
def test_a_mode_recording_the_ops_sees_the_kernel_as_one_op(layer):
    """The CPU stand-in for CUDA graphs records the ops a step dispatched: a routed call made behind torch's back
    would replay as an empty tensor, so under a dispatch mode the call takes the full way to the kernel's op."""
    linear, packs, full = layer
    seen: list[str] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    x = torch.randn(1, 3, 64)
    with torch.inference_mode(), packs.active(), Record():
        out = linear(x)
    assert torch.equal(out, stock(linear, x))
    assert full == [1] and any("row_kernel_linear" in name for name in seen), seen


@needs_kernel
def test_a_replaced_weight_is_not_kept_alive_by_its_route(layer):
    linear, packs, full = layer
    ref = weakref.ref(linear.weight)
    linear.weight = torch.nn.Parameter(torch.randn(64, 64))
    gc.collect()
    assert ref() is None
    x = torch.randn(1, 3, 64)
    with torch.inference_mode(), packs.active():
        assert torch.equal(linear(x), stock(linear, x))
    assert full == [1]


@needs_kernel
def test_prefill_shapes_make_no_routes(two_threads):
    model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    packs = PrepackedLinears(model, pack=False)
    with torch.inference_mode(), packs.active():
        for rows in range(MAX_ROWS + 1, MAX_ROWS + 40):
            model(torch.randn(1, rows, 64))
    assert len(vars(model[0])["forward"]._routes) == 0
    packs.close()


@needs_kernel
def test_a_shape_settled_on_f_linear_calls_it_straight(two_threads, trial_clock, monkeypatch):
    real = RowKernel.linear

    def slow(self, x, weight, bias, order, threads):
        trial_clock[0] += 0.75  # every timed kernel call looks slower than F.linear
        return real(self, x, weight, bias, order, threads)

    monkeypatch.setattr(RowKernel, "linear", slow)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    packs, linear = PrepackedLinears(model, pack=False), model[0]
    x = torch.randn(1, 2, 64)
    with torch.inference_mode(), packs.active():
        for _ in range(3 * TRIALS + 3):
            assert torch.equal(linear(x), stock(linear, x))
        assert packs.row_split.settled((64, 64, True), 2, 2) == "plain"
        assert vars(linear)["forward"]._routes[x.shape] is PLAIN
        monkeypatch.setattr(PrepackedLinears, "linear", lambda *args: pytest.fail("the full way"))
        assert torch.equal(linear(x), stock(linear, x))
    with torch.enable_grad():
        out = linear(x.clone().requires_grad_())
        assert out.requires_grad and torch.equal(out.detach(), stock(linear, x))
    packs.close()


def test_the_fixed_routes_serve_nothing_themselves():
    for route in (NO_ROUTE, PLAIN):
        assert not route.serves(torch.randn(1, 8), torch.randn(8, 8), None)
        assert isinstance(route, Route)


@needs_kernel
def test_the_compiled_steps_op_routes_by_weight_parameter_and_shape(two_threads, kernel_wins, monkeypatch):
    """The compiled step's linears call ``few_rows`` (the ``pagedcore::row_linear`` op): once a parameter's shape
    settled on the kernel, it is routed too; a tensor that is not a parameter (a gathered head slice, new each call)
    is never given one."""
    from pagedcore.adapters.transformers import row_split

    model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    packs, linear = PrepackedLinears(model, pack=False), model[0]
    loose = torch.randn(64, 64)
    with torch.inference_mode(), packs.active():
        for _ in range(3 * TRIALS + 3):
            x = torch.randn(1, 3, 64)
            assert torch.equal(packs.few_rows(x, linear.weight, linear.bias), stock(linear, x))
            assert torch.equal(packs.few_rows(x, loose, None), F.linear(x, loose))
        if packs.row_split.kernel_order((64, 64, True), 3, 2) is None:
            pytest.skip("the kernel's bits matched F.linear's at 3 rows nowhere on this CPU")
        assert packs._op_routes.keys() == [(id(linear.weight), torch.Size([1, 3, 64]))]
        full: list[int] = []
        real = row_split.RowSplit.linear
        monkeypatch.setattr(row_split.RowSplit, "linear", lambda *a, **k: full.append(1) or real(*a, **k))
        x = torch.randn(1, 3, 64)
        assert torch.equal(packs.few_rows(x, linear.weight, linear.bias), stock(linear, x)) and full == []
        linear.weight.mul_(0.5)  # in place: read as it is now
        assert torch.equal(packs.few_rows(x, linear.weight, linear.bias), stock(linear, x)) and full == []
        other = torch.nn.Parameter(torch.randn(64, 64))  # another parameter: its own way, the full one first
        assert torch.equal(packs.few_rows(x, other, linear.bias), F.linear(x, other, linear.bias)) and full == [1]
    packs.close()
    assert len(packs._op_routes) == 0


@needs_kernel
def test_a_route_knows_the_weight_it_was_made_for():
    kernel, weight, x = load(), torch.randn(8, 8), torch.randn(1, 8)
    assert kernel is not None
    route = Route(kernel.prepared(x, weight, None, Order.blocks(8, 1), 1), weight, None)
    assert route.made_for(weight) and not route.made_for(torch.randn(8, 8))
    del weight
    gc.collect()
    assert not route.made_for(torch.randn(8, 8))
    assert not NO_ROUTE.made_for(x) and not PLAIN.made_for(x)
