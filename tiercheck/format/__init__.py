"""The one on-disk format, pure over values: `naming` (every file and directory name a tier
holds), `tree` (the state's JSON tree and the exact encoding of plain values), `manifest`
(the schema, its parser and its builder's entries), `checksum`, `dtypes`. `docs/format.md`
is its written spec.
"""

FLOOR = 1
