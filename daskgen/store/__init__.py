"""The Zarr store: its layout, where it lives, its lock, packing into shards."""
