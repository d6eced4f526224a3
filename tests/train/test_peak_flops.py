"""The peak that MFU divides by: given, or measured per machine (best of spaced rounds) and cached, on this
process's own devices; raised when a step beats a measured peak, so that MFU never exceeds 100%."""

import json
import math
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import pytest

from nnx_zoo.train import TrainConfig
from nnx_zoo.train import metrics as m


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path


def _cache(cache_home):
    return json.loads((cache_home / "nnx_zoo" / "peak_flops.json").read_text())[m.machine_key()]


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_cpu_peak_is_measured_once_per_machine_and_reused(cache_home, monkeypatch):
    calls = []
    monkeypatch.setattr(m, "measure_cpu_peak_flops", lambda: calls.append(1) or 160e9)
    first, source1 = m.peak_flops_per_device()
    second, source2 = m.peak_flops_per_device()
    assert len(calls) == 1
    n = jax.local_device_count()
    assert first == second == 160e9 / n
    path = cache_home / "nnx_zoo" / "peak_flops.json"
    assert f"measured now, cached in {path}" in source1
    # the summary's source names the method and the numbers
    assert "measured on " in source2 and str(path) in source2 and f"160 GFLOP/s / {n} devices" in source2
    assert m.cpu_peak_method() in source2 and "best of 5 rounds" in source2
    entry = _cache(cache_home)
    assert entry["flops"] == 160e9 and entry["method"] == m.cpu_peak_method()
    assert entry["method_version"] == m.CPU_PEAK_METHOD_VERSION
    # another machine (host, CPU, cores or jax version) gets its own measurement
    monkeypatch.setattr(m, "machine_key", lambda: "other-host | some CPU | 64 cores | jax 0.0")
    monkeypatch.setattr(m, "measure_cpu_peak_flops", lambda: calls.append(1) or 900e9)
    assert m.peak_flops_per_device()[0] == 900e9 / n
    assert len(calls) == 2 and len(json.loads(path.read_text())) == 2


def test_a_corrupt_cache_is_measured_again(cache_home, monkeypatch):
    path = cache_home / "nnx_zoo" / "peak_flops.json"
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    monkeypatch.setattr(m, "measure_cpu_peak_flops", lambda: 100e9)
    assert m.peak_flops_per_device()[1].endswith(f"measured now, cached in {path}")
    assert _cache(cache_home)["flops"] == 100e9


def test_an_entry_of_the_old_one_burst_method_is_measured_again_keeping_the_higher(cache_home, monkeypatch):
    # Entries written before the spaced rounds (one burst, maybe under load) get a new measurement.
    path = cache_home / "nnx_zoo" / "peak_flops.json"
    path.parent.mkdir(parents=True)
    old = {"flops": 50e9, "measured_on": "2024-01-01", "method": "best of 30 float32 1024^3 matmuls after 3 warmups"}
    path.write_text(json.dumps({m.machine_key(): old}))
    monkeypatch.setattr(m, "measure_cpu_peak_flops", lambda: 150e9)
    assert m.cpu_peak_flops()[0] == 150e9
    assert _cache(cache_home)["method_version"] == m.CPU_PEAK_METHOD_VERSION
    # ... and an old entry above the new measurement (this one under load) is kept
    path.write_text(json.dumps({m.machine_key(): {**old, "flops": 300e9}}))
    flops, source = m.cpu_peak_flops()
    assert flops == 300e9 and "kept the older cached 300 GFLOP/s over 150 GFLOP/s" in source


def test_given_peak_wins_and_bad_ones_are_refused(cache_home, monkeypatch):
    monkeypatch.setattr(m, "measure_cpu_peak_flops", lambda: pytest.fail("a given peak must not be measured"))
    assert m.peak_flops_per_device(2e12) == (2e12, "given by --peak-flops")
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="positive"):
            m.peak_flops_per_device(bad)
        with pytest.raises(ValueError, match="peak_flops_per_device must be"):
            TrainConfig(peak_flops_per_device=bad)


def test_a_peak_measured_under_load_is_raised_and_mfu_stays_at_most_one(cache_home, monkeypatch):
    # Under load the first measurement reads 3x too low; the quiet re-measurement reads the true 300 GFLOP/s.
    measurements = iter([100e9, 300e9])
    calls = []
    monkeypatch.setattr(m, "measure_cpu_peak_flops", lambda: calls.append(1) or next(measurements))
    clock = FakeClock()
    n = jax.local_device_count()
    peak = m.resolve_peak()
    peak.clock = clock
    assert peak.kind == "measured" and peak.value == 100e9 / n and len(calls) == 1
    assert peak.mfu(50e9 / n, step=1) == pytest.approx(0.5)  # below the peak: no re-measurement
    assert len(calls) == 1
    # a step at 250 GFLOP/s on this host beats the measured 100: re-measure once (300), MFU 250/300
    mfu = peak.mfu(250e9 / n, step=2)
    assert len(calls) == 2 and mfu == pytest.approx(250 / 300)
    assert peak.value == 300e9 / n and peak.raises == 1
    assert "raised at step 2 after a training step ran at 250 GFLOP/s on this host" in peak.source
    assert "re-measured now: 300 GFLOP/s" in peak.source and f"300 GFLOP/s / {n} devices" in peak.source
    # a still faster step within the interval is not measured again, but the peak rises to its rate: MFU 1.0
    clock.now += 10
    assert peak.mfu(330e9 / n, step=3) == 1.0
    assert len(calls) == 2 and peak.value == pytest.approx(330e9 / n)
    for step, rate in enumerate([320e9, 330e9, 329e9, 331e9], start=4):  # noise around the peak
        mfu = peak.mfu(rate / n, step=step)
        assert mfu is not None and 0 < mfu <= 1.0
    assert len(calls) == 2
    # the cache holds the raised peak, so the next run on this machine starts from it without measuring
    entry = _cache(cache_home)
    assert entry["flops"] == pytest.approx(331e9) and entry["measured_flops"] == 300e9 and "raised_by" in entry
    monkeypatch.setattr(m, "measure_cpu_peak_flops", lambda: pytest.fail("the raised peak must be reused"))
    next_run = m.resolve_peak()
    assert next_run.value == pytest.approx(331e9 / n)
    assert "raised on " in next_run.source and "a training step ran at 331 GFLOP/s" in next_run.source
    assert next_run.mfu(331e9 / n) == pytest.approx(1.0)


def test_the_remeasurement_is_rate_limited(cache_home, monkeypatch):
    calls = []
    monkeypatch.setattr(m, "measure_cpu_peak_flops", lambda: calls.append(1) or 100e9)
    clock = FakeClock()
    peak = m.resolve_peak(recheck_interval_s=60.0)
    peak.clock = clock
    n = peak.devices
    rate = 100e9
    for _ in range(20):  # a beating step every 10 s for 200 s: measured again at 0, 60, 120 and 180 s
        rate *= 1.01
        assert peak.mfu(rate / n) == 1.0
        clock.now += 10
    assert len(calls) == 1 + 4
    assert peak.raises == 20 and peak.value == pytest.approx(rate / n)


def test_the_raise_of_another_process_is_taken_without_measuring(cache_home, monkeypatch):
    monkeypatch.setattr(m, "measure_cpu_peak_flops", lambda: 100e9)
    mine = m.resolve_peak()
    other = m.resolve_peak()
    n = mine.devices
    other.mfu(200e9 / n)  # the other process re-measures (100) and raises the cache to 200
    monkeypatch.setattr(m, "measure_cpu_peak_flops", lambda: pytest.fail("already raised by the other process"))
    assert mine.mfu(150e9 / n) == pytest.approx(0.75)
    assert mine.value == pytest.approx(200e9 / n) and "another process cached" in mine.source


@pytest.mark.parametrize("kind", ["given", "data sheet"])
def test_a_stated_peak_is_never_measured_and_mfu_clamps_with_one_warning(cache_home, monkeypatch, kind):
    monkeypatch.setattr(m, "measure_cpu_peak_flops", lambda: pytest.fail("a stated peak must not be measured"))
    peak = m.resolve_peak(100e9) if kind == "given" else m.Peak(100e9, "data sheet: X", kind="data sheet")
    assert peak.mfu(50e9) == 0.5 and peak.exceeded_by is None
    with pytest.warns(RuntimeWarning, match="FLOP count or the peak is wrong") as caught:
        assert peak.mfu(120e9, step=7) == 1.0
        assert peak.mfu(150e9, step=8) == 1.0
        assert peak.mfu(90e9) == 0.9
    assert len(caught) == 1
    assert peak.value == 100e9 and peak.exceeded_by == 150e9
    assert "up to 150 GFLOP/s per device, first at step 7" in peak.source and "clamped to 100%" in peak.source
    assert not (cache_home / "nnx_zoo").exists()


def test_an_unknown_peak_gives_no_mfu(cache_home):
    peak = m.Peak(math.nan, "unknown device kind 'X'", kind="unknown")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert peak.mfu(1e12) is None
    assert m.resolve_peak(1e9).mfu(math.nan) is None


def test_the_measurement_takes_the_best_of_spaced_rounds(monkeypatch):
    # Round 1 runs under load (every matmul 3x slow), round 2 is quiet but for one slow matmul, round 3 is noisy.
    size = 64
    seconds = iter([3.0, 3.3, 3.1,  1.2, 1.0, 4.0,  2.0, 1.5, 1.8])
    sleeps = []
    monkeypatch.setattr(m, "_time_matmul", lambda matmul, a: next(seconds))
    monkeypatch.setattr(m.time, "sleep", sleeps.append)
    flops = m.measure_cpu_peak_flops(size=size, warmups=1, repeats=3, rounds=3, gap_s=0.2)
    assert flops == pytest.approx(2 * size**3 / 1.0)
    assert sleeps == [0.2, 0.2]  # spaced: a pause between rounds, none before the first
    with pytest.raises(ValueError, match="rounds >= 1"):
        m.measure_cpu_peak_flops(rounds=0)


def test_measured_peak_is_plausible():
    flops = m.measure_cpu_peak_flops(size=256, warmups=1, repeats=3, rounds=2, gap_s=0.01)
    assert 1e8 < flops < 1e13  # FLOP/s of one CPU host: not a dispatch-only timing


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_every_process_of_a_two_process_run_reports_the_same_sensible_peak(tmp_path):
    # Process 1 once timed a matmul on process 0's device (jax.devices()[0]), which it does not run: 499,880
    # GFLOP/s. Both processes share this host and its cache: the second waits for the first and reuses its peak.
    # Then both see a step at 3x the peak: one re-measures and raises the cache, the other takes that raise.
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
    raised = [r["raised_peak"] for r in results]
    assert raised[0] == raised[1] >= 3 * peaks[0], results
    assert all(r["mfu"] <= 1.0 for r in results), results
    assert sorted("another process cached" in r["raised_source"] for r in results) == [False, True], results
