"""The peak that MFU divides by: given, or measured once per machine and cached, on this process's own devices."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from nnx_zoo.train import TrainConfig
from nnx_zoo.train import metrics as m


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path


def test_cpu_peak_is_measured_once_per_machine_and_reused(cache_home, monkeypatch):
    calls = []
    monkeypatch.setattr(m, "measure_cpu_peak_flops", lambda: calls.append(1) or 160e9)
    first, source1 = m.peak_flops_per_device()
    second, source2 = m.peak_flops_per_device()
    assert len(calls) == 1
    assert first == second == 160e9 / jax.local_device_count()
    path = cache_home / "nnx_zoo" / "peak_flops.json"
    assert f"measured now, cached in {path}" in source1
    assert "cached on " in source2 and str(path) in source2 and "160 GFLOP/s / 8 devices" in source2
    assert json.loads(path.read_text())[m.machine_key()]["flops"] == 160e9
    # another machine (host, CPU, cores or jax version) gets its own measurement
    monkeypatch.setattr(m, "machine_key", lambda: "other-host | some CPU | 64 cores | jax 0.0")
    monkeypatch.setattr(m, "measure_cpu_peak_flops", lambda: calls.append(1) or 900e9)
    assert m.peak_flops_per_device()[0] == 900e9 / jax.local_device_count()
    assert len(calls) == 2 and len(json.loads(path.read_text())) == 2


def test_a_corrupt_cache_is_measured_again(cache_home, monkeypatch):
    path = cache_home / "nnx_zoo" / "peak_flops.json"
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    monkeypatch.setattr(m, "measure_cpu_peak_flops", lambda: 100e9)
    assert m.peak_flops_per_device()[1].endswith(f"measured now, cached in {path}")
    assert json.loads(path.read_text())[m.machine_key()]["flops"] == 100e9


def test_given_peak_wins_and_bad_ones_are_refused(cache_home, monkeypatch):
    monkeypatch.setattr(m, "measure_cpu_peak_flops", lambda: pytest.fail("a given peak must not be measured"))
    assert m.peak_flops_per_device(2e12) == (2e12, "given by --peak-flops")
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="positive"):
            m.peak_flops_per_device(bad)
        with pytest.raises(ValueError, match="peak_flops_per_device must be"):
            TrainConfig(peak_flops_per_device=bad)


def test_measured_peak_is_plausible():
    flops = m.measure_cpu_peak_flops(size=256, warmups=1, repeats=3)
    assert 1e8 < flops < 1e13  # FLOP/s of one CPU host: not a dispatch-only timing


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_every_process_of_a_two_process_run_reports_the_same_sensible_peak(tmp_path):
    # Process 1 once timed a matmul on process 0's device (jax.devices()[0]), which it does not run: 499,880
    # GFLOP/s. Both processes share this host and its cache: the second waits for the first and reuses its peak.
    script = Path(__file__).with_name("peak_flops_process.py")
    env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "XDG_CACHE_HOME": str(tmp_path)}
    coordinator = f"127.0.0.1:{_free_port()}"
    procs = [subprocess.Popen([sys.executable, str(script), coordinator, str(i)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for i in range(2)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    peaks = [r["peak"] for r in results]
    assert peaks[0] == peaks[1], results
    assert 1e8 < peaks[0] < 1e13, results  # per device of a CPU host with 4 local devices
    assert sorted("measured now" in r["source"] for r in results) == [False, True], results
