"""Chunks and their state: a chunk (``chunk``) is its layout (``chunk_layout``), its residency
(``chunk_residency``) and its gradients (``chunk_grads``); per-parameter state (``tensor_state``); this
rank's shard of it in every tier (``shard``, ``grad_shard``, ``master_buffer``, ``param_on_disk``, ``grad_on_disk``);
the manager that packs parameters into chunks (``manager``) at the size the search picks (``search``)."""
