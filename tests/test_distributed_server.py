"""`zcode serve` under torchrun with --tensor-parallel-size 2 or --pipeline-parallel-size 2
(gloo), and what a lost rank does.

The oracle for outputs is a one-process server on the same model (itself held to transformers by
test_parity.py and to the client by test_server.py): the embedded SmolLM2-135M in float32, whose
9 query heads in 3 KV groups split 6 + 3. The failure tests run the tiny llama checkpoint (token
id prompts: it has no tokenizer) and kill or stop one rank while a request is in flight: that
request must end with an error naming the rank failure and the launch must exit non-zero, within
a hang guard (a bound on hanging, not on speed).
"""

import os
import signal
import threading
import time
from pathlib import Path

import openai
import pytest
from remote_server import TP2_STARTUP_TIMEOUT_S, RemoteServer, free_port, torchrun

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name three colors."}]
ARGS = ("--max-model-len", "512", "--kv-cache-mib", "64", "--dtype", "float32")
TP_ARGS = ("--tensor-parallel-size", "2")
SPLITS = {"tp2": TP_ARGS, "pp2": ("--pipeline-parallel-size", "2")}
EXIT_TIMEOUT_S = 120  # a hang guard for the launch to end after a rank is lost
RANK_FAILURE = "a collective failed"


def test_a_torchrun_launch_without_the_split_is_a_clear_error(monkeypatch):
    """Else each process would load the whole model and all but one fail to take the port."""
    from zcode.errors import ValidationError
    from zcode.server.launch import run_server

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValidationError, match="--tensor-parallel-size 2"):
        run_server(None, port=free_port())


# -- outputs: two ranks against one process


@pytest.fixture(scope="module")
def single():
    with RemoteServer(*ARGS) as s:
        yield s


# Pipeline-parallel serving is `slow` (in .ci/run): the default suite's 15-minute budget.
@pytest.fixture(
    scope="module",
    params=[pytest.param(s, marks=pytest.mark.slow) if s == "pp2" else s for s in sorted(SPLITS)],
)
def tp(request):
    """A two-rank server, tensor- or pipeline-parallel (the fixture keeps its first name)."""
    launcher = torchrun()
    with RemoteServer(
        *ARGS, *SPLITS[request.param], "--shutdown-timeout", "20", launcher=launcher,
        startup_timeout_s=TP2_STARTUP_TIMEOUT_S,
    ) as s:  # fmt: skip
        yield s


def test_the_follower_builds_its_kernels_before_rank_0_reports_ready(tp):
    """They are built before the follower's handshake, which rank 0's start-up waits for."""
    assert tp.request("GET", "/health")[0] == 200
    output = tp.output()
    assert output[: output.index("serving")].count("C++ kernels:") == 2, output


def test_completions_equal_one_process_and_stream_equals_whole(tp, single):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    whole = tp.client().completions.create(**kwargs)
    assert whole == single.client().completions.create(**kwargs).model_copy(
        update={"id": whole.id, "created": whole.created}
    )
    chunks = list(tp.client().completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text != ""
    ids = [[504, 3575, 282, 4649, 314], [1204, 2135, 253]]
    batch = dict(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    texts = [c.text for c in tp.client().completions.create(**batch).choices]
    assert texts == [c.text for c in single.client().completions.create(**batch).choices]


def test_chat_equals_one_process_and_stream_equals_whole(tp, single):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_completion_tokens=16, temperature=0)
    whole = tp.client().chat.completions.create(**kwargs)
    oracle = single.client().chat.completions.create(**kwargs)
    assert whole.choices[0].message.content == oracle.choices[0].message.content
    assert whole.usage == oracle.usage
    chunks = list(tp.client().chat.completions.create(**kwargs, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content != ""


def test_sigterm_on_rank_0_drains_and_every_rank_exits_zero(tp):
    """Last for the module's server: rank 0 finishes the request in flight, then stops the
    follower; torchrun exits 0 only if both ranks did."""
    client, result = tp.client(), {}

    def in_flight():
        result["out"] = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip

    thread = threading.Thread(target=in_flight)
    thread.start()
    deadline = time.monotonic() + 60
    while tp.metrics()["zcode:num_requests_running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(tp.rank_pids()[0], signal.SIGTERM)
    assert tp.proc.wait(EXIT_TIMEOUT_S) == 0, tp.output()
    thread.join(EXIT_TIMEOUT_S)
    assert result["out"].choices[0].finish_reason == "length"
    assert result["out"].usage.completion_tokens == 24
    assert "rank 1: rank 0 finished" in tp.output()


# -- a lost rank

TINY = "tiny-llama"


def _tiny_tp_server(tiny_checkpoint, *options: str, torchrun_options=()) -> RemoteServer:
    args = (str(tiny_checkpoint("llama").path), *TP_ARGS, "--served-model-name", TINY)
    args += ("--dtype", "float32", "--kv-cache-mib", "8", *options)
    launcher = torchrun(*torchrun_options)
    return RemoteServer(*args, launcher=launcher, startup_timeout_s=TP2_STARTUP_TIMEOUT_S)


def _stream_in_flight(server: RemoteServer) -> dict:
    """Starts a long greedy stream (`_start_stream`) and returns once the engine runs it (a
    tokenizer-less model streams no text until the end)."""
    result = _start_stream(server)
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    while server.metrics()["zcode:num_requests_running"] == 0:
        assert time.monotonic() < deadline and result["thread"].is_alive(), server.output()
        time.sleep(0.02)
    return result


def _start_stream(server: RemoteServer) -> dict:
    """Starts a long greedy stream; the dict gets the stream's `error` or last `finish_reason`
    and is complete once its `thread` ends."""
    result = {}

    def consume():
        try:
            for chunk in server.client().completions.create(
                model=TINY, prompt=[5, 6, 7, 8], max_tokens=500, temperature=0, stream=True,
                extra_body={"ignore_eos": True},
            ):  # fmt: skip
                result["finish_reason"] = chunk.choices[0].finish_reason
        except openai.APIError as e:
            result["error"] = str(e)

    result["thread"] = threading.Thread(target=consume)
    result["thread"].start()
    return result


def _assert_request_fails(server: RemoteServer) -> None:
    """A request after the failure gets an error status, or no connection once the server is
    gone; never a hang."""
    body = {"model": TINY, "prompt": [5, 6], "max_tokens": 2}
    try:
        status, reply = server.request("POST", "/v1/completions", body)
    except TimeoutError:
        pytest.fail(f"the request hung:\n{server.output()}")
    except OSError:  # refused or reset: the server has exited
        return
    assert status in (500, 503), reply


def _assert_failed_in_flight(server: RemoteServer, stream: dict, failure: str) -> None:
    stream["thread"].join(EXIT_TIMEOUT_S)
    assert not stream["thread"].is_alive(), f"the stream hung:\n{server.output()}"
    assert "error" in stream, stream
    assert RANK_FAILURE in stream["error"] and "relaunch torchrun" in stream["error"]
    _assert_request_fails(server)
    assert server.proc.wait(EXIT_TIMEOUT_S) != 0
    assert f"zcode: error: rank 0 of 2: {RANK_FAILURE}" in server.output()
    assert failure in server.output()


def test_a_killed_follower_fails_the_request_in_flight_and_ends_the_launch(tiny_checkpoint):
    with _tiny_tp_server(tiny_checkpoint) as server:
        follower = server.rank_pids()[1]
        stream = _stream_in_flight(server)
        os.kill(follower, signal.SIGKILL)
        _assert_failed_in_flight(server, stream, "Signal 9 (SIGKILL) received")


@pytest.mark.slow  # tens of seconds (in .ci/run)
def test_a_hung_follower_fails_the_request_after_the_collective_timeout(tiny_checkpoint):
    """The follower stops (SIGSTOP) mid-stream: rank 0's all-reduce waits the 5 s collective
    timeout, then fails; torchrun kills the stopped follower after its own 5 s."""
    with _tiny_tp_server(
        tiny_checkpoint, "--collective-timeout-s", "5", torchrun_options=("--shutdown-timeout", "5")
    ) as server:
        follower = server.rank_pids()[1]
        stream = _stream_in_flight(server)
        os.kill(follower, signal.SIGSTOP)
        _assert_failed_in_flight(server, stream, "Timed out")


@pytest.mark.slow  # tens of seconds (in .ci/run)
def test_a_follower_stopped_between_steps_fails_the_next_request_after_the_timeout(
    tiny_checkpoint,
):
    """The follower stops (SIGSTOP) while it waits for rank 0's next step: rank 0's broadcast of
    the step waits the collective timeout for it, then fails. (Before, rank 0 waited with the
    followers' days-long idle timeout: the request and the launch hung.)"""
    with _tiny_tp_server(
        tiny_checkpoint, "--collective-timeout-s", "5", torchrun_options=("--shutdown-timeout", "5")
    ) as server:
        os.kill(server.rank_pids()[1], signal.SIGSTOP)
        stream = _start_stream(server)  # its first step is the one rank 0 cannot hand over
        _assert_failed_in_flight(server, stream, "Timed out")


@pytest.mark.slow  # tens of seconds (in .ci/run)
def test_sigterm_on_torchrun_drains_the_request_in_flight(tiny_checkpoint):
    """torchrun forwards SIGTERM to both ranks: rank 0 drains, the follower ignores it and runs
    rank 0's steps until rank 0 stops it (torchrun, signalled, exits non-zero itself)."""
    with _tiny_tp_server(tiny_checkpoint, torchrun_options=("--shutdown-timeout", "60")) as server:
        stream = _stream_in_flight(server)
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(EXIT_TIMEOUT_S)
        stream["thread"].join(EXIT_TIMEOUT_S)
        output = server.output()
        assert stream.get("finish_reason") == "length", (stream, output)
        assert "Finished server process" in output and "rank 1: rank 0 finished" in output
        assert "forcefully exiting" not in output  # no rank needed torchrun's SIGKILL


def test_the_follower_exits_on_its_own_when_rank_0_dies(tiny_checkpoint):
    """torchrun would kill it only after 300 s (its --shutdown-timeout; the follower ignores the
    SIGTERM before): an exit within the hang guard is the follower's own."""
    with _tiny_tp_server(tiny_checkpoint, torchrun_options=("--shutdown-timeout", "300")) as server:
        os.kill(server.rank_pids()[0], signal.SIGKILL)
        assert server.proc.wait(EXIT_TIMEOUT_S) != 0
        assert f"zcode: error: rank 1 of 2: {RANK_FAILURE}" in server.output()


def _running(pid: int) -> bool:
    """A process that exists and has not exited (an orphan's zombie waits for init to reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.slow  # tens of seconds (in .ci/run)
def test_every_rank_ends_when_torchrun_itself_is_killed(tiny_checkpoint):
    """torchrun killed with SIGKILL forwards nothing: each rank asked Linux for a SIGTERM when
    its launcher dies, so rank 0 drains and exits and the follower follows it. (Before, both
    served on as orphans: found leaked by killed test runs, an hour old.)"""
    with _tiny_tp_server(tiny_checkpoint) as server:
        ranks = server.rank_pids()
        os.kill(server.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + EXIT_TIMEOUT_S
        while any(_running(pid) for pid in ranks.values()):
            assert time.monotonic() < deadline, f"ranks {ranks} outlived torchrun"
            time.sleep(0.1)
