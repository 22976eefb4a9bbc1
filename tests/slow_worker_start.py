"""Test double: a Dask worker preload (``DASK_DISTRIBUTED__WORKER__PRELOAD='["tests.slow_worker_start"]'``) that
keeps each worker starting for 30 s, so a test can signal a run while its cluster starts."""

import time


def dask_setup(worker: object) -> None:
    time.sleep(30)
