"""Imported last by the fork server that starts the ranks (``distributed._PRELOAD``): what the
imports made (about 370,000 objects: torch, transformers, chunkmem) moves to the garbage
collector's permanent generation, so that a forked process's full collections, its own and a
test's ``gc.collect()`` before measuring memory, do not walk it each time (about a second each on
a loaded 2-core machine). That is what ``gc.freeze`` is for in a process that forks: the children
also stop copying the pages those objects sit on when a collection would have touched them."""

import gc

gc.collect()
gc.freeze()
