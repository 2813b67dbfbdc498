"""From a live training state to values and back: `flatten` (validation, the JSON tree and
the byte leaves) and `structure` (the cache that skips flattening while the structure is
unchanged).
"""

FLOOR = 2
