"""Reaching objects on object storage and by URL: the obstore client, writes retried after a dropped
connection, an image's bytes read from its URL."""
