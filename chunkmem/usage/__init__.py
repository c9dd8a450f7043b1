"""Memory usage: the exact byte ledger per location and kind (``accounting``), the counters a user
reads with ``model.stats()`` (``stats``), and the probes of device and host memory (``memory``)."""
