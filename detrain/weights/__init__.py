"""Checkpoint files: atomic save and the one safe load (``checkpoint``), the restricted reader that
vets every byte before torch sees it (``safe_pickle``, ``torch_zip``, ``safe_torch``, ``safe_numpy``, ``limits``,
``nesting``, ``hash_keys``, ``inert``), Ultralytics checkpoints (``ultralytics``) and weights by name (``hub``).
"""
