"""Doors from other trainers into chunkmem. Each submodule imports its trainer library when it is
imported itself (``chunkmem.integrations.hf`` imports ``transformers`` and ``accelerate``);
``import chunkmem`` imports none of them."""
