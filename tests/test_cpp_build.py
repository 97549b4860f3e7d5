"""zcode/kernels/cpp_build.py: a torch build `lock` left by a killed build is cleared (torch
itself would wait on it forever), a live holder is waited for, and checkouts of the same source
share one build while a changed source gets its own."""

import multiprocessing
import os
import threading
from pathlib import Path

from zcode.kernels.cpp_build import build_lock, build_ops


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


def test_checkouts_of_one_source_share_a_build_and_a_change_gets_its_own(tmp_path, monkeypatch):
    """torch (ninja) rebuilds when a source's path changes: every checkout compiles the same
    copy, filed under the source's digest."""
    import torch.utils.cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    calls = []
    monkeypatch.setattr(
        torch.utils.cpp_extension, "load", lambda name, sources, **kw: calls.append((name, sources))
    )
    sources = []
    for checkout, text in (("a", "// ops\n"), ("b", "// ops\n"), ("c", "// ops, changed\n")):
        (tmp_path / checkout).mkdir()
        sources.append(tmp_path / checkout / "ops.cpp")
        sources[-1].write_text(text)
        assert build_ops("zcode_x", sources[-1], "falls back")
    (a_name, a_sources), (b_name, b_sources), (c_name, c_sources) = calls
    assert (a_name, a_sources) == (b_name, b_sources)
    assert c_name != a_name and c_sources != a_sources
    for (_, [copy]), source in zip(calls, sources):
        assert Path(copy).read_text() == source.read_text()
        assert Path(copy).parent.parent == tmp_path / "ext"
