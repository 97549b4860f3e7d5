import dataclasses
import importlib
import json
import platform
import subprocess
import sys

import pytest

from zcode.hardware import CudaDevice, HardwareInfo, format_report, probe

# The submodule, not the `probe` function the package re-exports under the same name.
probe_mod = importlib.import_module("zcode.hardware.probe")

SMALL = dict(buffer_bytes=16 << 20, gemm_seconds=0.02)


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> HardwareInfo:
    return probe(cache_dir=tmp_path_factory.mktemp("hw"), **SMALL)


@pytest.fixture
def fake_measure(monkeypatch) -> list[int]:
    """Replaces the measurement with a constant one; the list counts the calls."""
    calls = []

    def measure(buffer_bytes: int, gemm_seconds: float) -> probe_mod.Measurements:
        calls.append(buffer_bytes)
        return probe_mod.Measurements(10.0, 8.0, buffer_bytes, 50.0, None, 20.0, 0.0)

    monkeypatch.setattr(probe_mod, "measure", measure)
    return calls


def test_probe_measures_sane_values(measured):
    """On Linux, where /proc and /sys expose every static fact and torch 2.13's CPU build has
    bf16 and int8 matmuls, nothing may come back unknown (None is for other platforms)."""
    info = measured
    assert sys.platform == "linux" and platform.machine() == "x86_64", (
        "the facts below are Linux x86's"
    )
    assert 0.5 < info.read_bandwidth_gbps < 1000
    assert 0.5 < info.copy_bandwidth_gbps < 1000
    assert info.bandwidth_buffer_bytes == SMALL["buffer_bytes"]
    assert info.fp32_gflops > 1
    assert info.bf16_gflops > 0 and info.int8_gops > 0
    assert 1 <= info.num_physical_cores <= info.num_logical_cores
    assert info.num_threads >= 1
    assert info.total_memory_bytes > 1 << 20
    for size in (info.l1d_cache_bytes, info.l2_cache_bytes, info.l3_cache_bytes):
        assert size >= 1024
    assert all(isinstance(f, str) for f in info.isa_flags)
    assert len(set(info.isa_flags)) == len(info.isa_flags)
    assert set(info.isa_flags) <= set(probe_mod.ISA_FLAGS_OF_INTEREST)
    # torch only picks its AVX2 / AVX512 kernels on a CPU that has AVX2.
    assert info.torch_cpu_capability in ("AVX2", "AVX512") and "avx2" in info.isa_flags
    assert info.other_load_cores >= 0  # Linux: /proc/stat is readable
    json.dumps(dataclasses.asdict(info))


def test_second_call_reads_the_cache_and_refresh_remeasures(tmp_path, fake_measure):
    first = probe(cache_dir=tmp_path, **SMALL)
    (path,) = tmp_path.glob("hardware-*.json")
    assert json.loads(path.read_text())["read_bandwidth_gbps"] == 10.0
    assert probe(cache_dir=tmp_path, **SMALL) == first
    assert len(fake_measure) == 1
    probe(refresh=True, cache_dir=tmp_path, **SMALL)
    assert len(fake_measure) == 2


@pytest.mark.parametrize(
    "content",
    ["{not json", "[]", '{"cpu_model": "x"}', "", '{"read_bandwidth_gbps": null}'],
)
def test_corrupted_cache_is_ignored_and_rewritten(tmp_path, fake_measure, content):
    first = probe(cache_dir=tmp_path, **SMALL)
    (path,) = tmp_path.glob("hardware-*.json")
    path.write_text(content)
    assert probe(cache_dir=tmp_path, **SMALL) == first
    assert len(fake_measure) == 2
    assert json.loads(path.read_text()) == json.loads(json.dumps(dataclasses.asdict(first)))


def test_cache_with_nonpositive_measurement_is_ignored(tmp_path, fake_measure):
    probe(cache_dir=tmp_path, **SMALL)
    (path,) = tmp_path.glob("hardware-*.json")
    path.write_text(json.dumps({**json.loads(path.read_text()), "fp32_gflops": 0.0}))
    assert probe(cache_dir=tmp_path, **SMALL).fp32_gflops == 50.0
    assert len(fake_measure) == 2


def test_cache_dir_from_environment(tmp_path, monkeypatch, fake_measure):
    monkeypatch.delenv("ZCODE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert probe_mod.default_cache_dir() == tmp_path / "xdg" / "zcode"
    monkeypatch.setenv("ZCODE_CACHE_DIR", str(tmp_path / "explicit"))
    probe(**SMALL)
    assert len(list((tmp_path / "explicit").glob("hardware-*.json"))) == 1


def test_unwritable_cache_dir_still_returns_info(tmp_path, fake_measure):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert probe(cache_dir=blocker / "sub", **SMALL).read_bandwidth_gbps == 10.0


def test_missing_system_files_degrade_to_none(tmp_path, monkeypatch, fake_measure):
    def no_lscpu(*args, **kwargs):
        raise FileNotFoundError("lscpu")

    monkeypatch.setattr(probe_mod, "_read", lambda path: None)
    monkeypatch.setattr(probe_mod.subprocess, "run", no_lscpu)
    info = probe(cache_dir=tmp_path, **SMALL)
    assert info.isa_flags is None
    assert info.num_physical_cores is None
    assert (info.l1d_cache_bytes, info.l2_cache_bytes, info.l3_cache_bytes) == (None,) * 3
    assert "unknown" in format_report(info)
    assert probe(cache_dir=tmp_path, **SMALL) == info


def test_cache_sizes_fall_back_to_lscpu(monkeypatch):
    out = "NAME  ONE-SIZE\nL1d      49152\nL1i      65536\nL2     2097152\nL3   503316480\n"
    monkeypatch.setattr(probe_mod, "_read", lambda path: None)
    monkeypatch.setattr(
        probe_mod.subprocess,
        "run",
        lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout=out, stderr=""),
    )
    assert probe_mod._cache_sizes() == {
        "L1d": 49152,
        "L1i": 65536,
        "L2": 2097152,
        "L3": 503316480,
    }


def test_cuda_devices_round_trip_through_the_cache(tmp_path, monkeypatch, fake_measure):
    device = CudaDevice("Fake GPU", 80 << 30, 132, (9, 0))
    monkeypatch.setattr(probe_mod, "_cuda_devices", lambda: (device,))
    info = probe(cache_dir=tmp_path, **SMALL)
    assert probe(cache_dir=tmp_path, **SMALL) == info
    assert len(fake_measure) == 1
    assert "Fake GPU" in format_report(info) and "sm_90" in format_report(info)


def test_format_report_mentions_bandwidth_and_every_flag(measured):
    report = format_report(measured)
    assert "bandwidth" in report and f"{measured.read_bandwidth_gbps:.1f}" in report
    assert "GFLOP/s" in report
    for flag in measured.isa_flags or ():
        assert flag in report
    every_flag = dataclasses.replace(measured, isa_flags=probe_mod.ISA_FLAGS_OF_INTEREST)
    report = format_report(every_flag)
    for flag in probe_mod.ISA_FLAGS_OF_INTEREST:
        assert flag in report
    assert "absent" not in report


def test_report_says_when_the_probe_ran_on_a_busy_machine(measured):
    idle = dataclasses.replace(measured, other_load_cores=0.0, num_logical_cores=2)
    busy = dataclasses.replace(idle, other_load_cores=1.9)
    unknown = dataclasses.replace(idle, other_load_cores=None)
    assert "zcode hw --refresh" in format_report(busy)
    assert "kept 1.9 of 2 cores busy" in format_report(busy)
    assert "refresh" not in format_report(idle) and "refresh" not in format_report(unknown)


def test_other_load_is_the_cpu_time_of_other_processes_over_the_wall_time(monkeypatch):
    """All processes used 3 CPU seconds in 2 wall seconds, 1 of them this process's own: the
    others kept 1 core busy. A measurement's own threads never count as load."""
    from zcode.hardware import load
    from zcode.hardware.load import _Sample

    samples = iter([_Sample(10.0, 100.0, 5.0), _Sample(12.0, 103.0, 6.0)])
    monkeypatch.setattr(load, "_sample", lambda: next(samples))
    assert load.measure_other_load(lambda: "result") == ("result", 1.0)
    samples = iter([_Sample(10.0, 100.0, 5.0), _Sample(12.0, 101.0, 6.0)])  # own time only
    assert load.measure_other_load(lambda: None) == (None, 0.0)
    monkeypatch.setattr(load, "_sample", lambda: None)  # no /proc/stat
    assert load.measure_other_load(lambda: 7) == (7, None)


def test_a_measurements_own_child_processes_are_not_other_load(monkeypatch):
    """CPU time of children the process waited for (inductor's compilers in a compiled fit) is
    the measurement's own: a quiet fit was reported as timed beside 0.5 busy cores."""
    import os

    from zcode.hardware import load

    times = os.times_result((1.0, 0.5, 2.0, 0.25, 0.0))  # user, system, children's, elapsed
    monkeypatch.setattr(load.os, "times", lambda: times)
    sample = load._sample()
    if sample is None:  # no /proc/stat: nothing to sample on this system
        assert not os.path.exists("/proc/stat")
        return
    assert sample.own_s == 3.75
