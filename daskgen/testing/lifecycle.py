"""The conformance checks of an engine's life: an unknown option is refused, and shutdown is idempotent.

:class:`LifecycleChecks` is mixed into :class:`~daskgen.testing.conformance.EngineConformance`.  The shutdown check
shuts the suite's shared engine down, so it is named in ``runs_last``: :func:`~daskgen.testing.harness.run_checks` runs
it after the others (the project's ``tests/conftest.py`` orders pytest's items so), and under another order the
suite's ``setup_method`` starts a new shared engine for the check after it.
"""

from __future__ import annotations

from typing import Any, ClassVar

from daskgen.engines.base import EngineStatus, FinishReason
from daskgen.errors import ConfigError, EngineError


class LifecycleChecks:
    """Start and stop checks; uses the helpers of :class:`~daskgen.testing.conformance.EngineConformance`."""

    #: Checks that shut the shared engine down: run after the others.
    runs_last: ClassVar[tuple[str, ...]] = ("test_shutdown_is_idempotent",)
    engine: ClassVar[Any]
    engine_class: ClassVar[Any]
    run: Any
    request: Any
    make_engine: Any

    def test_unknown_engine_arg(self) -> None:
        """An unknown engine option raises ConfigError naming it."""
        key = "no_such_option_xyz"
        try:
            engine = self.make_engine(**{key: 1})
        except ConfigError as exc:
            assert key in str(exc), exc
            return
        try:
            self.run(engine.start())
        except ConfigError as exc:
            assert key in str(exc), exc
        else:
            raise AssertionError(f"{self.engine_class.__name__} accepted the unknown option {key!r}")
        finally:
            self.run(engine.shutdown())

    def test_shutdown_is_idempotent(self) -> None:
        """shutdown() works unstarted and twice, start() after it raises, and generate() afterwards fails cleanly.

        Shuts the shared engine down (one of ``runs_last``)."""
        unstarted = self.make_engine()
        self.run(unstarted.shutdown())
        assert unstarted.status is EngineStatus.CLOSED, unstarted.status
        try:
            self.run(unstarted.start())
        except EngineError:
            pass
        else:
            raise AssertionError("start() after shutdown() did not raise EngineError")
        engine = self.engine
        assert engine.status is EngineStatus.RUNNING, engine.status
        request = self.request("before-shutdown", 1, max_new_tokens=2)
        assert self.run(engine.generate(request)).error is None
        self.run(engine.shutdown())
        self.run(engine.shutdown())
        assert engine.status is EngineStatus.CLOSED, engine.status
        try:
            late = self.run(engine.generate(request))
        except EngineError:
            return
        assert late.error is not None and late.finish_reason == FinishReason.ERROR, late
