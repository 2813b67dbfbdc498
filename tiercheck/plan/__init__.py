"""Pure decisions over values: this rank's part of a save (`placement`), shard offsets
(`shards`), a step's manifest from its plan (`stepdoc`), moving parts between layouts
(`retarget`), the order steps may be written in (`steporder`), retention (`retention`)
and when to save (`schedule`). Nothing here starts a thread or touches a file.
"""

FLOOR = 3
