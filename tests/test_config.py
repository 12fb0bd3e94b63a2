"""One config per owner (issue 27): PoolConfig, SchedulerConfig and EngineConfig validated once, one size parser,
accepted by the Engine, enable(), PagedCache, PagedKVPool and the server's flags (keyword arguments build them); and
errors that carry the field they concern (``param``)."""

from __future__ import annotations

import argparse

import pytest
import torch
from models import tiny_model

from pagedcore import SchedulerConfig
from pagedcore.adapters import transformers as pc
from pagedcore.config import PoolConfig, parse_size
from pagedcore.engine import EngineConfig
from pagedcore.errors import ConfigError, InvalidRequestError

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------------------- sizes
@pytest.mark.parametrize(
    ("value", "size"),
    [(4096, 4096), (1.5e6, 1_500_000), ("2GiB", 2 * 2**30), ("512 MB", 512 * 10**6), ("1.5k", 1500), (" 8MiB ", 2**23)],
)
def test_one_parser_reads_every_size(value, size):
    assert parse_size(value) == size


@pytest.mark.parametrize("value", [True, -1, float("inf"), float("nan"), "lots", "2 parsecs", "-3GiB", None, [1]])
def test_sizes_that_are_not_sizes_are_refused_naming_the_setting(value):
    with pytest.raises(ConfigError, match="--x must be a size like") as caught:
        parse_size(value, name="--x")
    assert caught.value.param == "--x"


# ---------------------------------------------------------------------------------------------------- PoolConfig
@pytest.mark.parametrize(
    ("settings", "message", "param"),
    [
        ({"num_blocks": 8, "memory_budget": "1MiB"}, "not both", "num_blocks"),
        ({"num_blocks": 0}, "num_blocks must be a positive integer", "num_blocks"),
        ({"block_size": True}, "block_size must be a positive integer", "block_size"),
        ({"memory_budget": "lots"}, "memory_budget must be a size", "memory_budget"),
        ({"kv_store": "/tmp"}, "needs kv_store_bytes", "kv_store"),
        ({"kv_store_bytes": "1GiB"}, "give kv_store= too", "kv_store_bytes"),
        ({"kv_layout": "rows"}, "kv_layout must be one of", "kv_layout"),
    ],
)
def test_pool_settings_are_checked_once_where_they_are_built(settings, message, param):
    with pytest.raises(ConfigError, match=message) as caught:
        PoolConfig(**settings)
    assert caught.value.param == param


def test_every_holder_takes_a_pool_config_and_its_keywords_build_the_same():
    model = tiny_model("llama")
    config = PoolConfig(num_blocks=12, block_size=4, eviction_policy="lru")
    for pool in (
        pc.PagedKVPool(model, config),
        pc.PagedKVPool(model, num_blocks=12, block_size=4, eviction_policy="lru"),
    ):
        assert (pool.num_blocks, pool.block_size, pool.config.eviction_policy) == (12, 4, "lru")
    cache = pc.PagedCache(model, config=PoolConfig(num_blocks=6, block_size=4))
    assert cache.pool.num_blocks == 6 and cache.pool.kv_layout == "auto"  # a cache's own pool: its default layout
    enabled = pc.enable(model, config=config)
    try:
        assert enabled.num_blocks == 12
    finally:
        pc.disable(model)
    with pc.Engine(model, config=EngineConfig(pool=config, scheduler=SchedulerConfig(max_num_seqs=3))) as engine:
        assert engine.pool.num_blocks == 12 and engine.scheduler.config.max_num_seqs == 3
        assert engine.config == EngineConfig.of(num_blocks=12, block_size=4, eviction_policy="lru", max_num_seqs=3)


def test_a_config_and_keyword_arguments_are_not_both_taken():
    model = tiny_model("llama")
    with pytest.raises(ConfigError, match="not both"):
        pc.PagedKVPool(model, PoolConfig(num_blocks=8), num_blocks=16)
    with pytest.raises(ConfigError, match="not both"):
        pc.Engine(model, config=EngineConfig(), max_num_seqs=4)
    with pytest.raises(ConfigError, match="not an Engine setting: colour"):
        EngineConfig.of(colour="red")
    assert model.config._attn_implementation != "paged"  # refused before anything changed


def test_a_shared_pool_refuses_every_setting_of_a_new_pool():
    """PagedCache(pool=..., block_size=...) ignored block_size (it shaped only a private pool): now refused."""
    model = tiny_model("llama")
    pool = pc.PagedKVPool(model, num_blocks=16, block_size=4)
    with pytest.raises(ConfigError, match=r"pool settings \(block_size=8\) make a new pool: not with pool="):
        pc.PagedCache(model, pool=pool, block_size=8)
    with pytest.raises(ConfigError, match="make a new pool"):
        pc.Engine(model, pool=pool, eviction_policy="lru")


# ---------------------------------------------------------------------------------------------------- EngineConfig
@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"max_logprobs": -2}, "max_logprobs must be an integer >= -1"),
        ({"max_model_len": 0}, "max_model_len must be an integer >= 1"),
        ({"compile": "always"}, 'compile must be True, False, "auto" or "cudagraphs"'),
        ({"compile_timeout": 0}, "compile_timeout must be > 0 seconds"),
        ({"max_num_seqs": 0}, "max_num_seqs must be an integer >= 1"),
        ({"scheduling_policy": "lifo"}, "policy must be one of"),
    ],
)
def test_engine_settings_are_checked_once(settings, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig.of(**settings)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"watermark": "0.1"}, "watermark must be a number in [0, 1), got '0.1'"),
        ({"watermark": True}, "watermark must be a number in [0, 1), got True"),
        ({"watermark": float("nan")}, "watermark must be a number in [0, 1), got nan"),
        ({"watermark": 1}, "watermark must be a number in [0, 1), got 1"),
        ({"enable_prefix_caching": "no"}, "enable_prefix_caching must be True or False, got 'no'"),
        ({"enable_prefix_caching": 1}, "enable_prefix_caching must be True or False, got 1"),
        ({"enable_prefix_caching": None}, "enable_prefix_caching must be True or False, got None"),
    ],
)
def test_scheduler_settings_of_the_wrong_type_are_refused_naming_them(settings, message):
    with pytest.raises(ConfigError) as caught:
        SchedulerConfig(**settings)
    assert str(caught.value) == message and caught.value.param == next(iter(settings))


def test_scheduler_settings_of_the_right_type_are_taken():
    assert SchedulerConfig(watermark=0).watermark == 0 and SchedulerConfig(watermark=0.5).watermark == 0.5
    assert SchedulerConfig(enable_prefix_caching=False).enable_prefix_caching is False


def test_max_model_len_is_the_context_served_and_at_most_the_models():
    model = tiny_model("llama", max_position_embeddings=128)
    with pytest.raises(ConfigError, match="max_model_len 256 is more than the model's context of 128"):
        pc.Engine(model, num_blocks=16, max_model_len=256)
    with pc.Engine(model, num_blocks=64, block_size=4, max_model_len=32) as engine:
        assert engine.context.limit == 32 and engine.max_new_tokens(30) == 2
        with pytest.raises(InvalidRequestError, match="over the context of 32 tokens") as caught:
            engine.add_request([5] * 30, max_new_tokens=3)
        assert caught.value.param == "max_new_tokens"


def test_the_servers_flags_are_an_engine_config():
    from pagedcore.serve import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(
        ["--memory-budget", "1MiB", "--block-size", "8", "--max-num-seqs", "5", "--max-model-len", "100"]
    )
    config = cli.engine_config(args)
    assert config.pool == PoolConfig(memory_budget=2**20, block_size=8)
    assert config.scheduler.max_num_seqs == 5 and config.max_model_len == 100 and config.compile == "auto"


# ---------------------------------------------------------------------------------------------------- param
@pytest.mark.parametrize(
    ("prompt", "params", "param"),
    [
        ([5, 500], {}, "prompt"),  # out of the vocabulary
        ([], {}, "prompt"),
        ([5.5], {}, "prompt"),
        ([5, 6], {"max_new_tokens": -1}, "max_new_tokens"),
        ([5, 6], {"logprobs": 50}, "logprobs"),
        ([5, 6], {"logit_bias": {999: 1.0}}, "logit_bias"),
        ([5, 6], {"stop_token_ids": [999]}, "stop_token_ids"),
        ([5, 6], {"n": 99}, "n"),
        ([5, 6], {"stop_strings": ["\n"]}, "stop_strings"),  # stop strings need a tokenizer
    ],
)
def test_the_engines_refusals_name_their_field(prompt, params, param):
    model = tiny_model("llama")
    with pc.Engine(model, num_blocks=32, block_size=4, max_num_seqs=8) as engine:
        with pytest.raises(InvalidRequestError) as caught:
            engine.add_request(torch.tensor(prompt) if prompt and isinstance(prompt[0], float) else prompt, params)
        assert caught.value.param == param, caught.value
        assert "req-" not in str(caught.value)  # no internal request id in what a server shows its client
        assert not engine.has_unfinished()
