"""Paged attention: the float32 `reference` and kernel variants by name (`registry`)."""
