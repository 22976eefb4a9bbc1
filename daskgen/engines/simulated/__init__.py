"""The ``simulated`` engine: a timing model of a continuous-batching server (not a model).

:mod:`~daskgen.engines.simulated.engine` is the engine and its step loop,
:mod:`~daskgen.engines.simulated.plan` its options and what each request produces.
"""

from daskgen.engines.simulated.engine import SimulatedEngine
from daskgen.engines.simulated.plan import SimulatedArgs

__all__ = ["SimulatedArgs", "SimulatedEngine"]
