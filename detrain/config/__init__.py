"""Arguments: every key of every command in typed sections (one source for defaults, checks, ``--help``,
``cfg/default.yaml`` and which commands take a key), reading one value, and ``k=v`` parsing into one frozen
:class:`~detrain.config.cfg.Cfg`. Imports only the ground (``errors``, ``system``, ``log``) and ``distributed``
(``nnodes`` read by the launcher's own parser); the layers above import it (``tests/unit/test_layers.py``).
"""
