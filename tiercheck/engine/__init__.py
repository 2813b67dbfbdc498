"""The only long-lived threads: the `pipeline` that runs a save's writes, uploads and
retention in the background, its `workers` and their `priority`, and `tracking` of each
save until it is durable.
"""

FLOOR = 7
