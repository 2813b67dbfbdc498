"""What a run tells the outside while it works: `events` (the per-save record and the
``tiercheck.events`` logger) and `progress` (progress bars and callbacks); and `collector`, the
cyclic garbage collector paused around work that makes and frees an object a leaf. With
`tiercheck.errors`, the ground floor: every other floor may import it; it imports nothing.
"""

FLOOR = 0
