"""pagedcore.serve.ray on a local Ray cluster: two engine replicas of a tiny model behind the OpenAI ingress.

One cluster for the module (``ray.init(num_cpus=2)``); each app's replicas reserve half a CPU, so the prefix app and
the random-routing app of the hit-rate test fit together. Everything is shut down at the end of the module.
"""

from __future__ import annotations

import importlib.util
import random
import socket
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from pagedcore.adapters.transformers import Engine, SamplingParams  # noqa: E402
from pagedcore.serve.ray import ModelSpec, build_app, deploy  # noqa: E402
from pagedcore.serve.ray.deployment import ENGINE_DEPLOYMENT  # noqa: E402

TINY = ModelSpec(builtin_overrides={"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128}, threads=1)
MODEL = "pagedcore-builtin"
# Each replica's pool holds about 28 blocks of 16 tokens: 5 of the 8 system prompts below, not all 8 (see the
# hit-rate test).
ENGINE = {"num_blocks": 28, "block_size": 16, "max_num_seqs": 16}
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
REQUEST_BOUND_S = 120  # no request may take longer than this, whatever happens to the replicas


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def port():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        yield free_port()
    finally:
        serve.shutdown()
        ray.shutdown()


def start(port: int, name: str, routing: str) -> str:
    app = build_app(TINY, replicas=2, routing=routing, engine_kwargs=ENGINE, num_cpus_per_replica=0.5)
    return deploy(app, name=name, route_prefix=f"/{name}", port=port)


@pytest.fixture(scope="module")
def prefix_url(port):
    return start(port, "prefix", "prefix")


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=REQUEST_BOUND_S, max_retries=0)


def reference(prompts, max_new_tokens):
    model, tokenizer = TINY.load()
    with Engine(model, tokenizer, **ENGINE) as engine:
        return engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens), use_tqdm=False)


def test_greedy_answers_through_the_ingress_equal_engine_generate_alone(prefix_url):
    prompts = ["Once upon a time", "Once upon a midnight", "The tide comes in", "x"]
    expected = reference(prompts, 12)
    api = client(prefix_url)
    for prompt, want in zip(prompts, expected):
        out = api.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        assert out.choices[0].text == want.text
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(want.prompt_token_ids), 12)
        streamed = api.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True)
        assert "".join(chunk.choices[0].text for chunk in streamed) == want.text
    greedy = api.completions.create(
        model=MODEL, prompt=[list(w.prompt_token_ids) for w in expected], max_tokens=12, temperature=0
    )
    assert [c.text for c in greedy.choices] == [w.text for w in expected]
    assert greedy.usage.completion_tokens == 12 * len(prompts)


def test_stop_strings_through_the_ingress_stop_where_the_engine_stops(prefix_url):
    (full,) = reference(["Once upon a time"], 16)
    stop = full.text[5:7]
    model, tokenizer = TINY.load()
    with Engine(model, tokenizer, **ENGINE) as engine:
        params = SamplingParams(max_new_tokens=16, stop_strings=[stop])
        (want,) = engine.generate(["Once upon a time"], params, use_tqdm=False)
    out = client(prefix_url).completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0, stop=[stop]
    )
    assert out.choices[0].text == want.text == full.text[: full.text.find(stop)]
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == len(want.token_ids)


def test_chat_models_health_and_bad_input_through_the_ingress(prefix_url):
    api = client(prefix_url)
    assert [m.id for m in api.models.list().data] == [MODEL]
    chat = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5)
    assert chat.usage.completion_tokens == 5 and chat.choices[0].message.role == "assistant"
    assert httpx.get(f"{prefix_url}/health").json() == {"status": "ok"}
    with pytest.raises(openai.BadRequestError, match="temperature"):
        api.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=-1)
    with pytest.raises(openai.BadRequestError, match="the prompt is empty"):
        api.completions.create(model=MODEL, prompt="", max_tokens=2)
    assert metrics(prefix_url)['pagedcore_requests_total{status="invalid"}'] == 2


def metrics(url: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(f"{url}/metrics", timeout=REQUEST_BOUND_S).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def settled_metrics(url: str, **expected: float) -> dict[str, float]:
    """/metrics once it shows ``expected`` (the ingress polls its replicas every second); fails after the bound."""
    deadline = time.monotonic() + REQUEST_BOUND_S
    while True:
        values = metrics(url)
        if all(values.get(name) == value for name, value in expected.items()) or time.monotonic() > deadline:
            assert {name: values.get(name) for name in expected} == expected
            return values
        time.sleep(0.2)


def test_metrics_count_the_live_replicas_and_each_request_to_its_last_step(prefix_url):
    # Idle: both pools of 28 blocks, none held (1-2 showed as held before: the figures of a request's last report
    # were read before its last step was published, and nothing updated them after).
    idle = {"pagedcore_kv_blocks": 56.0, "pagedcore_kv_blocks_used": 0.0}
    before = settled_metrics(prefix_url, **idle)
    api = client(prefix_url)
    for index in range(3):
        out = api.completions.create(model=MODEL, prompt=f"Count me {index}", max_tokens=5, temperature=0)
        assert out.usage.completion_tokens == 5
    tokens = before["pagedcore_generation_tokens_total"] + 15
    settled_metrics(prefix_url, **idle, pagedcore_generation_tokens_total=tokens)


def hit_rate(url: str, systems: list[str], questions: list[str]) -> float:
    """Prompt tokens served from the replicas' prefix caches / prompt tokens, over the workload, one request at a
    time (interleaved: every system prompt once, then again with the next question)."""
    api = client(url)
    cached = total = 0
    for question in questions:
        for system in systems:
            out = api.completions.create(model=MODEL, prompt=system + question, max_tokens=1, temperature=0)
            cached += out.usage.prompt_tokens_details.cached_tokens
            total += out.usage.prompt_tokens
    return cached / total


def test_prefix_routing_hits_the_cache_far_more_than_random_routing(port, prefix_url):
    # 8 system prompts of 5 blocks x 16 questions. A replica's pool holds about 5 system prompts. Prefix routing
    # sends each system prompt to one replica (4 per replica): after its first request every request hits its 5
    # blocks, 80 of ~100 prompt tokens. Random routing makes each replica cycle through all 8 system prompts, and
    # LRU evicts most of them before they come back.
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    systems = [f"System {i}: " + "".join(rng.choice(letters) for _ in range(70)) for i in range(8)]
    questions = [f" Q{j}: " + "".join(rng.choice(letters) for _ in range(12)) for j in range(16)]
    prefix = hit_rate(prefix_url, systems, questions)
    random_url = start(port, "random", "random")
    try:
        baseline = hit_rate(random_url, systems, questions)
    finally:
        serve.delete("random")
    print(f"\nprefix hit rate: prefix routing {prefix:.1%}, random routing {baseline:.1%}")
    assert prefix >= 0.6
    assert prefix >= baseline + 0.25


def replica_requests() -> Counter[str]:
    handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name="prefix")
    reports = handle.broadcast("stats").results(timeout_s=REQUEST_BOUND_S)
    return Counter({r.replica: r.stats.engine.num_requests for r in reports})


def test_a_burst_of_one_hot_prefix_spreads_over_both_replicas(prefix_url):
    # 32 requests sharing a 3-block system prompt, sent together, each long enough (64 tokens, in pools that hold
    # a few at a time) to be in flight while the others are routed. 32/0 and 30/2 before the router counted its
    # own assignments; now no replica may get more than imbalance_threshold + 1 (9) over the other while they are
    # all in flight. A request that finished before the last one was even sent (a loaded machine's slow burst; the
    # faster the Engine, the likelier) no longer counts as load: each such one may add one to the totals' gap.
    api = client(prefix_url)
    system = "You are the hot prefix of a burst. " * 3
    start = threading.Barrier(32)
    before = replica_requests()
    errors: list[BaseException] = []
    sent: list[float] = []
    done: list[float] = []

    def send(index: int) -> None:
        start.wait(REQUEST_BOUND_S)
        try:
            sent.append(time.monotonic())
            api.completions.create(model=MODEL, prompt=f"{system}Q{index}", max_tokens=64, temperature=0)
            done.append(time.monotonic())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(REQUEST_BOUND_S)
    assert not errors and not any(thread.is_alive() for thread in threads)
    served = replica_requests()
    served.subtract(before)
    split = sorted(served.values())
    early = sum(finished < max(sent) for finished in done)
    print(f"\nburst of 32 hot-prefix requests over 2 replicas: {split} ({early} done before the last was sent)")
    assert len(split) == 2 and sum(split) == 32 and split[1] - split[0] <= 9 + early


def test_the_load_example_runs_through_the_ingress(port, prefix_url, capsys):
    spec = importlib.util.spec_from_file_location("example_ray_serve_load", EXAMPLES / "ray_serve_load.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    argv = ["--systems", "2", "--questions", "2", "--concurrency", "2", "--max-tokens", "2", "--routing", "prefix"]
    assert module.main([*argv, "--replicas", "1", "--port", str(port), "--cpus-per-replica", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "4 requests (2 system prompts x 2 questions)" in out and "1 replicas, prefix routing, requests=4" in out


def test_killing_a_replica_under_load_ends_every_request_and_the_ingress_serves_on(prefix_url):
    api = client(prefix_url)
    handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name="prefix")
    outcomes: list[str] = []
    first_chunk = threading.Semaphore(0)

    def stream(index: int) -> None:
        try:
            chunks = api.completions.create(
                model=MODEL, prompt=f"Request {index} runs long", max_tokens=300, temperature=0, stream=True
            )
            reason = None
            for index, chunk in enumerate(chunks):
                if index == 0:
                    first_chunk.release()
                reason = chunk.choices[0].finish_reason or reason
            outcomes.append("finished" if reason == "length" else f"ended without a finish reason: {reason}")
        except openai.APIError as exc:  # the clean failure: an error event in the stream, or a 5xx
            first_chunk.release()
            outcomes.append(f"error: {exc}")

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(12)]
    for thread in threads:
        thread.start()
    for _ in threads:
        assert first_chunk.acquire(timeout=REQUEST_BOUND_S)
    victim = handle.stats.remote().result(timeout_s=REQUEST_BOUND_S).replica
    ray.kill(ray.get_actor(victim, namespace="serve"))
    deadline = time.monotonic() + REQUEST_BOUND_S
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    assert not any(thread.is_alive() for thread in threads), "a request hung after the replica was killed"
    assert len(outcomes) == len(threads)
    print(f"\nafter the kill: {sum(o == 'finished' for o in outcomes)} finished, {len(outcomes)} requests")
    assert all(o == "finished" or o.startswith("error: ") for o in outcomes), outcomes
    for failed in (o for o in outcomes if o != "finished"):  # a generic message; the details go to the log
        assert victim not in failed and "pid" not in failed and "ip:" not in failed, failed
        assert "the engine replica serving request req-" in failed, failed
    # New requests are served right away: those routed to the dead replica are retried on the other one.
    for index in range(6):
        out = api.completions.create(model=MODEL, prompt=f"After the kill {index}", max_tokens=4, temperature=0)
        assert out.usage.completion_tokens == 4
    # Once Ray Serve has replaced the dead replica: two pools, not three (the dead one's figures summed for ever).
    settled_metrics(prefix_url, pagedcore_kv_blocks=56.0, pagedcore_kv_blocks_used=0.0)
