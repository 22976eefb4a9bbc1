"""The exit statuses of the ``daskgen`` command line, one table for every command."""

from __future__ import annotations

from enum import IntEnum

__all__ = ["MEANINGS", "ExitCode"]


class ExitCode(IntEnum):
    """What a ``daskgen`` process's exit status means (see :data:`MEANINGS`)."""

    OK = 0
    FAILED = 1
    ERROR = 2
    INTERRUPTED = 3
    STOPPED_AT_ONCE = 130


#: Each status, what it means and what to do next (the reference page of the docs is generated from it).
MEANINGS: dict[ExitCode, str] = {
    ExitCode.OK: (
        "Done: every prompt finished (or a stop condition ended the run early); `verify` found the store sound; "
        "any other command did what it was asked."
    ),
    ExitCode.FAILED: (
        "`run`: some prompt ended failed (its error is stored); every other prompt is done. Rerun with "
        "`--retry-failed` to generate only the failed rows. `verify`: problems were found (rerun with `--repair`)."
    ),
    ExitCode.ERROR: (
        "A clear error stopped the command before it could do harm: bad input or settings, a store that does not "
        "match the command, storage that cannot be reached, every engine failed, or a command-line usage error. "
        "Committed work is kept; fix what the message names and rerun the same command."
    ),
    ExitCode.INTERRUPTED: (
        "`run` was stopped from outside (SIGTERM, SIGINT, the end of its SLURM allocation minus `--grace`, or a "
        "lost Dask scheduler) with prompts still pending: finished partitions are committed and partial responses "
        "stored. Rerun the same command to resume (a SLURM job may requeue itself on this status). A stop that "
        "comes after every prompt ended gives the status of a run that was not stopped."
    ),
    ExitCode.STOPPED_AT_ONCE: (
        "A second signal stopped the process at once; what was committed is kept. Rerun the same command."
    ),
}
