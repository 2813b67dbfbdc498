"""What a run tells the outside while it works: `events` (the per-save record and the
``tiercheck.events`` logger) and `progress` (progress bars and callbacks). With
`tiercheck.errors`, the ground floor: every other floor may import it; it imports nothing.
"""

FLOOR = 0
