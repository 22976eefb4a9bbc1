"""The writer processes a worker starts (``daskgen.writer-processes``): the pool that writes finished regions to the
store beside the worker's event loop, and the shared memory the regions are handed over in."""
