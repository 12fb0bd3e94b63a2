"""One Engine's decode step with one of the direct layers' parts on and off, switched between rounds in the same
process (docs/benchmarks.md, "The norm in one C call, the screen's copy past the caches, and forward calls
straight").

``python scripts/direct_toggles_ab.py --part norm|calls|tape [--batch 1] [--rounds 6] [--threads 2] [--size small]``:
``norm`` is the RMSNorm in one C call (``DirectKernel.rms_norm``; off: torch's variance, then the C scale), ``calls``
the modules the direct layers still call through ``forward`` straight (``direct_layers._call``; off: through
``Module.__call__``), ``tape`` the decode step's layers as one C call (``decode_tape.py``; off: the direct layers'
Python). One Engine, ``--batch`` requests of 128-token prompts decoding (prefilled, then 30 steps
untimed); per round each setting takes 3 untimed steps and 25 timed ones, the settings' order alternating from
round to round (so the contexts, which grow, even out). Prints each setting's median of the rounds' median step and
their ratio. Separate processes are not compared: on a 2-core VM one process's steps differ from the next one's by
up to 5% (where its memory lands), more than these parts change them.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch

from pagedcore.adapters.transformers import Engine, SamplingParams
from pagedcore.adapters.transformers import direct_layers as direct_module
from pagedcore.adapters.transformers.decode_tape import Tapes
from pagedcore.benchmarks.common import BLOCK_SIZE, bench_model

STEPS, WARM = 25, 3


def switches(part: str, width: int, direct: direct_module.DirectLayers) -> Callable[[bool], None]:
    """A function turning ``part`` on (True) or off (False)."""
    if part == "tape":
        tapes = direct.tapes
        if not isinstance(tapes, Tapes) or not len(tapes):
            raise SystemExit("no decode tape here (no C compiler or AVX2, or a call that is not a C one)")
        return lambda on: setattr(tapes, "off", not on)
    if part == "norm":
        kernel = direct_module.load_kernel()
        if kernel is None or not kernel.sums_as_torch(torch.randn(2, width)):
            raise SystemExit("the norm's C sum does not serve here (no C compiler, or not torch's order)")
        return lambda on: kernel._widths.__setitem__(width, on)  # noqa: SLF001 (the width's verdict, as found)
    straight = direct_module._call  # noqa: SLF001 (part "calls")
    return lambda on: setattr(direct_module, "_call", straight if on else _module_call)


def _module_call(module: object, *args: object, **kwargs: object) -> object:
    return module(*args, **kwargs)  # type: ignore[operator]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", required=True, choices=("norm", "calls", "tape"), help="the part switched")
    parser.add_argument("--batch", type=int, default=1, help="requests decoding together")
    parser.add_argument("--rounds", type=int, default=6, help="timed rounds")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--size", default="small", help="benchmark model size")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = bench_model(size=args.size)
    rng = random.Random(0)
    new = 30 + args.rounds * 2 * (STEPS + WARM) + 10
    engine = Engine(model, num_blocks=64 + args.batch * (-(-(128 + new) // BLOCK_SIZE) + 1), block_size=BLOCK_SIZE,
                    max_num_seqs=args.batch)  # fmt: skip
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    for _ in range(args.batch):
        engine.add_request([rng.randrange(3, model.config.vocab_size) for _ in range(128)], params)
    for _ in range(30):
        engine.step()
    direct = engine.runner._direct  # noqa: SLF001
    assert direct is not None and direct.counts.verified
    switch = switches(args.part, model.config.hidden_size, direct)
    times: dict[bool, list[float]] = {True: [], False: []}
    for round_ in range(args.rounds):
        for on in (True, False) if round_ % 2 == 0 else (False, True):
            switch(on)
            for _ in range(WARM):
                engine.step()
            steps = []
            for _ in range(STEPS):
                start = time.perf_counter()
                engine.step()
                steps.append(time.perf_counter() - start)
            times[on].append(statistics.median(steps) * 1000)
    switch(True)
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print(
        f"{args.part}, batch {args.batch}: off {off:.3f} ms/step, on {on:.3f} ms/step: {off / on:.3f}x; rounds off "
        f"{[round(t, 2) for t in times[False]]}, on {[round(t, 2) for t in times[True]]}"
    )


if __name__ == "__main__":
    main()
