"""use_cpu_xla_flags: appends nnx_zoo's measured XLA:CPU flags without overriding the user's own."""

import warnings

import pytest

from nnx_zoo.platform import CPU_XLA_FLAGS, use_cpu_xla_flags

YNN = "--xla_cpu_experimental_ynn_fusion_type"


def test_flags_are_appended_to_existing_ones_once():
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    first = use_cpu_xla_flags(env)
    assert first.split() == ["--xla_force_host_platform_device_count=8"] + [f for f, _ in CPU_XLA_FLAGS]
    assert use_cpu_xla_flags(env) == first  # idempotent


def test_flags_set_when_unset():
    env: dict[str, str] = {}
    assert use_cpu_xla_flags(env).split() == [f for f, _ in CPU_XLA_FLAGS]


def test_users_own_value_wins():
    env = {"XLA_FLAGS": f"{YNN}="}  # the user switched every YNNPACK fusion off: keep that
    assert use_cpu_xla_flags(env) == f"{YNN}="


def test_every_flag_says_why():
    for flag, why in CPU_XLA_FLAGS:
        assert flag.startswith("--xla_") and "=" in flag and len(why) > 40


def test_warns_when_called_after_jax_started(monkeypatch):
    import jax.numpy as jnp

    jnp.ones(1).block_until_ready()  # the test process's backend is up
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    with pytest.warns(UserWarning, match="after JAX started a backend"):
        assert use_cpu_xla_flags() == "--xla_force_host_platform_device_count=8"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        use_cpu_xla_flags({})  # an explicit mapping is just edited: no check, no warning
