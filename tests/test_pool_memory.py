"""A memory budget is a ceiling: on the CPU the pool takes memory as its blocks are first written.

``enable(model, memory_budget="4GiB")`` used to zero-fill all 4 GiB at its first call (RSS 472 MiB -> 4,587 MiB for
the built-in model). The layer tensors now lie in anonymous memory that the operating system commits page by page as
blocks are written; ``memory_stats().reserved_bytes`` says how much was taken.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from models import tiny_model

from pagedcore.adapters import transformers as pc

pytestmark = pytest.mark.usefixtures("one_thread")

RSS_SCRIPT = textwrap.dedent(
    """
    import json, torch
    torch.set_num_threads(1)
    from pagedcore.adapters.transformers import enable
    from pagedcore.adapters.transformers.builtin import builtin_model, builtin_tokenizer

    def rss():
        return int(open("/proc/self/statm").read().split()[1]) * 4096

    model, tok = builtin_model(), builtin_tokenizer()
    ids = tok("Hello there, how are you?", return_tensors="pt")["input_ids"]
    model.generate(ids, max_new_tokens=16, do_sample=False)  # the model's own first-call memory, before the pool
    before = rss()
    pool = enable(model, memory_budget="4GiB")
    model.generate(ids, max_new_tokens=16, do_sample=False)
    stats = pool.memory_stats()
    print(json.dumps({"grew": rss() - before, "capacity": stats.capacity_bytes, "reserved": stats.reserved_bytes}))
    """
)


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads RSS from /proc")
def test_a_4gib_budget_takes_what_the_first_small_call_needs():
    done = subprocess.run([sys.executable, "-c", RSS_SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["capacity"] == 4 * 2**30
    assert 0 < figures["reserved"] < 2**20  # a few blocks of 25 + 16 tokens
    assert figures["grew"] < 64 * 2**20, figures  # was 4 GiB: the whole budget, zero-filled


def test_reserved_memory_grows_with_the_tokens_up_to_the_ceiling_and_stays(enabled):
    model = tiny_model("llama")
    pool = enabled(model, num_blocks=64, block_size=4)
    assert pool.memory_stats().reserved_bytes == 0  # nothing stored: no tensors yet
    per_block = pool.memory_stats().capacity_bytes // pool.num_blocks
    model.generate(torch.arange(5, 14)[None], max_new_tokens=3, do_sample=False)  # 11 positions stored: 3 blocks
    first = pool.memory_stats()
    assert first.reserved_bytes == 3 * per_block
    assert first.allocated_bytes > first.capacity_bytes  # address space for every block and the pad block
    model.generate(torch.arange(20, 60)[None], max_new_tokens=2, do_sample=False)  # 41 more positions: 11 blocks
    second = pool.memory_stats()
    assert second.reserved_bytes == (3 + 11) * per_block
    assert second.reserved_bytes <= second.capacity_bytes
    pool.clear_prefix_cache()  # the blocks go back to the pool, their pages stay the pool's
    assert pool.memory_stats().reserved_bytes == second.reserved_bytes


def test_untouched_blocks_read_as_zeros_and_written_ones_keep_their_values():
    model = tiny_model("llama")
    pool = pc.PagedKVPool(model, num_blocks=8, block_size=4)
    keys = torch.randn(4, model.config.num_key_value_heads, model.config.head_dim)
    key_cache, value_cache = pool.layer_kv(0, keys, keys)
    assert not key_cache.any() and not value_cache.any()
    key_cache[2] = keys
    assert torch.equal(pool.layer_tensors(0)[0][2], keys) and not pool.layer_tensors(0)[0][3].any()
