"""The process-wide ``SIGQUIT`` handler of the sglang engine, and the live backends it checks.

A failing sglang subprocess sends ``SIGQUIT`` to its parent (the Dask worker), whose default
action kills it.  :func:`install_sigquit_handler` replaces that with a crash check of every
registered :class:`~daskgen.engines.sglang.backend.SGLangBackend` (:func:`register`), so the
engine is marked crashed and restarted instead.  :func:`restore_sigquit_handler` gives the
signal its previous handler back once no backend is alive.
"""

from __future__ import annotations

import logging
import signal
import threading
import weakref
from typing import Any

__all__ = ["install_sigquit_handler", "live_backends", "register", "restore_sigquit_handler", "unregister"]

logger = logging.getLogger(__name__)


_BACKENDS: weakref.WeakSet[Any] = weakref.WeakSet()
_previous_sigquit: Any = None
_sigquit_installed = False


def _on_sigquit(signum: int, frame: Any) -> None:
    """Handle the SIGQUIT a failing sglang subprocess sends its parent: check, do not die."""
    logger.error("SIGQUIT received (an sglang subprocess reports a failure); checking the sglang engines")
    for backend in list(_BACKENDS):
        backend.poke()


def install_sigquit_handler() -> bool:
    """Make SIGQUIT from a failing sglang subprocess mark the engine crashed instead of killing us.

    Installed once per process; only possible on the main thread (returns False elsewhere).
    :meth:`SGLangEngine.start` calls it; call it yourself from the main thread when engines are
    started on another thread (e.g. a test's background event loop).
    """
    global _previous_sigquit, _sigquit_installed
    if _sigquit_installed:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    _previous_sigquit = signal.signal(signal.SIGQUIT, _on_sigquit)
    _sigquit_installed = True
    return True


def restore_sigquit_handler() -> None:
    """Give SIGQUIT back its previous handler once no engine is alive (main thread only)."""
    global _sigquit_installed
    if not _sigquit_installed or len(_BACKENDS) or threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGQUIT, _previous_sigquit if _previous_sigquit is not None else signal.SIG_DFL)
    _sigquit_installed = False


def register(backend: Any) -> None:
    """Check ``backend`` (anything with a ``poke()`` method) when ``SIGQUIT`` arrives."""
    _BACKENDS.add(backend)


def unregister(backend: Any) -> None:
    """Stop checking ``backend``."""
    _BACKENDS.discard(backend)


def live_backends() -> list[Any]:
    """The registered backends still alive."""
    return list(_BACKENDS)
