"""Plugs for training frameworks. Each submodule imports its framework when imported itself;
``import tiercheck`` imports none of them.

* `tiercheck.integrations.lightning`: ``TiercheckIO``, a Lightning ``CheckpointIO`` plugin
  (``pip install tiercheck[lightning]``).
* `tiercheck.integrations.accelerate`: ``save_state``/``load_state`` for an ``accelerate``
  ``Accelerator`` (``pip install tiercheck[accelerate]``).

See docs/integrations.md.
"""

FLOOR = 11
