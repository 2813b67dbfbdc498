"""Work on one step: stage it into host memory (`stage`), write its part to a tier
(`write`), copy it between tiers (`upload`), find the committed steps and open their
shards (`catalog`), restore it (`restore`), delete steps (`prune`), and the `handle`
a save returns.
"""

FLOOR = 6
