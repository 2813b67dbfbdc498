"""The ranks of one job agreeing with each other: the key-value `store` client every
protocol composes, the commit vote (`commit`), the restore and save agreements
(`agreement`, `trigger`), and `coordination`, which bundles them for one Checkpointer.
"""

FLOOR = 5
