"""Doors from the trainers people already use into chunkmem. Each submodule imports its trainer
library when it is imported itself (``chunkmem.integrations.hf`` imports ``transformers`` and
``accelerate``, ``chunkmem.integrations.lightning`` imports ``lightning``: the ``hf`` and
``lightning`` extras); importing ``chunkmem`` or this package imports none of them."""
