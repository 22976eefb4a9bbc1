"""The ``sglang`` engine: one in-process ``sglang.Engine`` per Dask worker.

:mod:`~daskgen.engines.sglang.engine` is the engine, :mod:`~daskgen.engines.sglang.backend` the
``sglang.Engine`` it owns (thread, loop, subprocesses), :mod:`~daskgen.engines.sglang.sigquit`
the ``SIGQUIT`` handler, :mod:`~daskgen.engines.sglang.args` the engine args and
:mod:`~daskgen.engines.sglang.mapping` sglang's request and output format (the last two are shared
with the ``openai`` engine's native protocol and managed server).  Importing this package does not
import sglang.
"""

from daskgen.engines.sglang.engine import SGLangEngine

__all__ = ["SGLangEngine"]
