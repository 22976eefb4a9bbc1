"""Side records: whole objects beside the Zarr group, read and written at the store's location (the lock,
followers' cursors, the requeue record)."""
