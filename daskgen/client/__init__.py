"""The client side of a run: plan it, drive partitions through the cluster, commit what finished.

Runs in the ``daskgen run`` process (or the Python caller of :func:`daskgen.generate`).
"""
