"""Test configuration: 8 fake CPU devices, set before jax is imported, so no mesh test is ever skipped."""

import gc
import os

# XLA:CPU's LLVM backend at -O0: the suite's programs are tiny and run a step or three, so compiling them is most of
# its time, and -O0 compiles about twice as fast (a deepseek3-tiny train step: 6.2 s -> 3.3 s; test_moe_exact.py
# 45 s -> 31 s, test_loop.py 51 s -> 33 s). It changes no HLO pass, so no program's semantics: float results move by
# rounding alone (that train step's loss by 2e-7 relative), far inside every tolerance here. Subprocesses that set
# their own device count append it to these flags (the last of a repeated flag wins).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0 --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

from nnx_zoo.sharding.mesh import reserve_cpu_workers  # noqa: E402

# Four XLA:CPU collective workers per device (PJRT_NPROC=32), before JAX starts its CPU client: with the default one
# per device, 1F1B on stage 2 x fsdp 4 aborted in a rendezvous timeout (see reserve_cpu_workers). Subprocesses inherit.
reserve_cpu_workers()

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session", autouse=True)
def _eight_devices():
    assert jax.device_count() == 8, f"tests need 8 CPU devices, got {jax.device_count()}: XLA_FLAGS was set too late"


MAX_MAPS_KEPT = 30_000  # of vm.max_map_count's usual 65530


def _memory_maps() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return 0


@pytest.fixture(scope="module", autouse=True)
def _free_compiled_programs():
    """Drop JAX's compiled programs after each test module (and after any test that leaves many behind).

    Every XLA:CPU executable kept alive holds memory mappings (~1500 for a small sharded train step); a process
    that keeps the suite's programs alive ran past the kernel's limit (``vm.max_map_count``, 65530 here), after
    which XLA:CPU's next compile crashed the interpreter (a segfault in CI, always at the same test).
    """
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(autouse=True)
def _bound_memory_maps():
    yield
    if _memory_maps() > MAX_MAPS_KEPT:
        jax.clear_caches()
        gc.collect()


@pytest.fixture(scope="module")
def _module_compile_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("jax-compile-cache")


@pytest.fixture
def subprocess_compile_cache(_module_compile_cache, monkeypatch):
    """Python processes a test starts (recipe runs, crash and signal tests) share JAX's persistent compilation
    cache, one directory per test module and worker: a relaunched run loads its compiled programs instead of
    compiling them again (a tiny recipe launch: 11 s -> 5 s). The test process itself is untouched (its jax read
    the setting at import), so tests that check what compiling prints still see it compile."""
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(_module_compile_cache))
    return _module_compile_cache


# The slowest modules first (measured: the recipes, DeepSeek-V4's and V3's mesh tests, the README's examples):
# pytest-xdist's load scheduling hands tests out in collection order, so the long ones no longer land at the end
# with one worker idle beside them. A stable sort: the order within each group stays the files'.
_SLOW_FIRST = ("tests/recipes/", "tests/models/deepseek4/", "tests/test_readme.py",
               "tests/models/deepseek/test_mesh_matrix.py", "tests/models/test_dense_sharding.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        return next((i for i, prefix in enumerate(_SLOW_FIRST) if item.nodeid.startswith(prefix)), len(_SLOW_FIRST))

    items.sort(key=rank)
