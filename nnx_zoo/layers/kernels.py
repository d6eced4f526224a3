"""The few facts every kernel chooser asks: the platform, whether tokamax imports, one warning line per fallback.

The lowest room of the kernels: the choosers (``choose_attention_impl`` in ``nnx_zoo.layers.attention``,
``default_moe_impl`` in ``nnx_zoo.layers.moe``, ``choose_grouped_matmul_impl`` in ``nnx_zoo.layers.grouped_matmul``)
import it, and ``nnx_zoo.layers.kernel_choices`` asks them all for a config.
"""

from __future__ import annotations

import importlib
import warnings
from types import ModuleType

import jax

_WARNED: set[str] = set()


def platform_name(platform: str | None = None) -> str:
    """``"cpu"``, ``"gpu"`` or ``"tpu"``: ``platform`` (``cuda``/``rocm`` count as ``gpu``), default JAX's
    backend.

    >>> platform_name("cuda")
    'gpu'
    """
    platform = (platform or jax.default_backend()).lower()
    return "gpu" if platform in ("cuda", "rocm") else platform


def tokamax() -> ModuleType | None:
    """The optional ``tokamax`` package (``pip install 'nnx-zoo[gpu]'``), or None when it does not import: a
    broken install (a missing dependency, an ABI mismatch) counts as missing, so no chooser picks it.

    >>> tokamax() is None  # without the gpu extra
    True
    """
    return None if tokamax_unavailable() else importlib.import_module("tokamax")


def tokamax_unavailable() -> str | None:
    """Why the ``tokamax`` kernels cannot run, for a fallback's warning (None: tokamax imports). An installed
    tokamax that fails to import (tokamax 0.0.13+ imports xprof's tools, which need ``fire``) is told apart from a
    missing one, with the import's own error.

    >>> tokamax_unavailable()  # without the gpu extra
    "tokamax is not installed (pip install 'nnx-zoo[gpu]')"
    """
    try:
        importlib.import_module("tokamax")
        return None
    except ModuleNotFoundError as e:
        if e.name == "tokamax":
            return "tokamax is not installed (pip install 'nnx-zoo[gpu]')"
        error: Exception = e
    except Exception as e:  # noqa: BLE001 - any import failure means the kernels cannot run
        error = e
    return (f"tokamax is installed but does not import ({type(error).__name__}: {error}); reinstall it with its "
            "dependencies (pip install 'nnx-zoo[gpu]')")


def warn_once(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """One warning line per distinct message per process (a traced function may be traced many times)."""
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, category, stacklevel=3)
