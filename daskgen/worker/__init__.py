"""What runs on a Dask worker: the engine plugin, the partition task, admission and draining."""
