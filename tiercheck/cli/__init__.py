"""The ``tiercheck`` command: one parser and dispatcher (`main`), the checkpoint tools'
subcommands (`tools`) and the goodput ones (`goodput`).
"""

FLOOR = 11
