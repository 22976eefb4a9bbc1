"""A chunk's bytes: the codec chain of every array, a local store's chunk files read directly, where an inner
chunk of a packed array lies in its shard."""
