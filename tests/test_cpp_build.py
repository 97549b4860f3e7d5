"""zcode/kernels/cpp_build.py's build lock: a torch build `lock` left by a killed build is
cleared (torch itself would wait on it forever), and a live holder is waited for."""

import multiprocessing
import os
import threading

from zcode.kernels.cpp_build import build_lock


def test_a_dead_builds_lock_file_is_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    stale = tmp_path / "zcode_x" / "lock"
    stale.parent.mkdir()
    stale.write_text("")
    with build_lock("zcode_x"):
        assert not stale.exists()


def _hold(path: str, held, release) -> None:
    os.environ["TORCH_EXTENSIONS_DIR"] = path
    with build_lock("zcode_x"):
        held.set()
        release.wait(60)


def test_a_live_build_is_waited_for(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    ctx = multiprocessing.get_context("fork")
    held, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(str(tmp_path), held, release))
    holder.start()
    assert held.wait(120)
    events = []

    def enter():
        with build_lock("zcode_x"):
            events.append("entered")

    waiter = threading.Thread(target=enter)
    waiter.start()
    waiter.join(1.0)
    assert events == []  # still held by the other process
    events.append("released")
    release.set()
    waiter.join(120)
    holder.join(120)
    assert events == ["released", "entered"]
