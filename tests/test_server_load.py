"""The server under load and at its edges (slow: run by `make test-slow`).

64 concurrent chats against outputs served alone, a burst of mid-stream disconnects, SIGTERM with
no grace period, and prefix reuse counted against a server without it (the time it saves is a
benchmark's to measure, not a test's). All traffic goes to a loopback server started here; every
loop is bounded in count and time.
"""

import asyncio
import json
import threading
import time

import pytest
from remote_server import RemoteServer

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
TOPICS = [
    "the sea", "a cat", "rain", "the moon", "bread", "a train", "winter", "a garden",
    "music", "a river", "coffee", "a library", "the wind", "a bicycle", "snow", "a lighthouse",
]  # fmt: skip


def messages(topic: str) -> list[dict]:
    return [{"role": "user", "content": f"Write one sentence about {topic}."}]


@pytest.fixture(scope="module")
def server():
    # float32: batched outputs are compared with each request served alone, and the file's
    # int8-activation kernels can flip a greedy near-tie between such runs (see test_server.py).
    args = ("--kv-cache-mib", "256", "--max-model-len", "1024", "--dtype", "float32")
    with RemoteServer(*args) as s:
        yield s


def test_64_concurrent_chats_match_each_served_alone(server):
    client = server.client()
    kwargs = dict(model=MODEL, max_tokens=16, temperature=0)
    alone = {
        t: client.chat.completions.create(messages=messages(t), **kwargs).choices[0].message.content
        for t in TOPICS
    }
    topics = TOPICS * 4

    async def burst():
        aclient = server.async_client()
        calls = [aclient.chat.completions.create(messages=messages(t), **kwargs) for t in topics]
        return await asyncio.wait_for(asyncio.gather(*calls), timeout=600)

    results = asyncio.run(burst())
    assert len(results) == 64
    mismatches = [
        (t, r.choices[0].message.content, alone[t])
        for t, r in zip(topics, results)
        if r.choices[0].message.content != alone[t]
    ]
    assert not mismatches, mismatches[:3]
    assert server.wait_idle()["zcode:num_requests_running"] == 0


def test_burst_of_disconnects_frees_everything(server):
    idle_kv = server.wait_idle()["zcode:kv_cache_usage_perc"]
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 500, "stream": True,
            "ignore_eos": True}  # fmt: skip
    connections = []
    for _ in range(16):
        conn = server.connection()
        conn.request("POST", "/v1/completions", json.dumps(body), server.headers())
        connections.append(conn)
    for conn in connections:
        response = conn.getresponse()
        assert response.status == 200
        response.readline()  # the first token arrived
    for conn in connections:
        conn.sock.shutdown(2)
        conn.close()
    after = server.wait_idle(timeout_s=60)
    assert after["zcode:num_requests_running"] == 0 == after["zcode:num_requests_waiting"]
    assert after["zcode:kv_cache_usage_perc"] == idle_kv
    out = server.client().completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert out.usage.completion_tokens == 2


def test_sigterm_without_grace_aborts_in_flight_and_exits_zero():
    with RemoteServer("--kv-cache-mib", "64", "--shutdown-timeout", "0") as s:
        result = {}

        def in_flight():
            result["out"] = s.client().completions.create(
                model=MODEL, prompt="Once upon a time", max_tokens=400,
                extra_body={"ignore_eos": True},
            )  # fmt: skip

        thread = threading.Thread(target=in_flight)
        thread.start()
        deadline = time.monotonic() + 30
        while s.metrics()["zcode:generation_tokens_total"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s.terminate(timeout_s=30) == 0
        thread.join(30)
        choice = result["out"].choices[0]
        assert choice.finish_reason == "abort" and result["out"].usage.completion_tokens < 400


SYSTEM = " ".join(f"Rule {i}: answer politely and briefly." for i in range(1, 102))


def ask_sharing_the_system_prompt(server: RemoteServer, num_requests: int) -> None:
    client = server.client()
    for i in range(num_requests):
        conversation = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Question {i}: what is {i} plus {i}?"},
        ]
        client.chat.completions.create(
            model=MODEL, messages=conversation, max_tokens=2, temperature=0
        )


def test_shared_system_prompt_is_reused():
    num_requests = 16
    args = ("--kv-cache-mib", "256", "--max-model-len", "2048")
    with RemoteServer(*args) as cached:
        num_tokens = cached.request("POST", "/tokenize", {"prompt": SYSTEM})[1]["count"]
        assert num_tokens >= 1000
        ask_sharing_the_system_prompt(cached, num_requests)
        m = cached.metrics()
        hit_rate = m["zcode:prefix_cache_hits_total"] / m["zcode:prefix_cache_queries_total"]
    with RemoteServer(*args, "--no-prefix-caching") as uncached:
        ask_sharing_the_system_prompt(uncached, 4)  # each prefills the whole system prompt
        assert uncached.metrics()["zcode:prefix_cache_hits_total"] == 0
    assert hit_rate > 0.8
