"""Chunks and their tensors: a chunk (``chunk``) is its layout (``chunk_layout``), its gathered buffer
(``chunk_residency``) and its gradient buffers (``chunk_grads``), whose state ``placement.DeviceResidency``
keeps; per-parameter state (``tensor_state``, legality checks of the hooks' order); this
rank's shard of it in every tier (``shard``, ``grad_shard``, ``master_buffer``, ``param_on_disk``, ``grad_on_disk``);
the manager that packs parameters into chunks (``manager``) at the size the search picks (``search``)."""
