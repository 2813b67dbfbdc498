"""Where a run's time went: the `runlog` written beside the checkpoints and the pure
`summary` over its records (``tiercheck report``, ``tiercheck plan``).
"""

FLOOR = 8
