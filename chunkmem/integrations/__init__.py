"""Doors from the trainers people already use into chunkmem. Each submodule imports its trainer
(an optional extra: ``pip install chunkmem[lightning]``) when it is imported itself; importing
``chunkmem`` or this package imports none of them."""
