"""Data: dataset yamls and their downloads, the built-in shapes set, the preparation of a split on a rank
(``prepare``), the dataset and its loaders, image reading, and predict's sources and frames; label checking
(``labels``), the training-sample pipeline (``samples``) and memory shared between processes (``memory``) are
folders of their own. Imports ``config``, ``metrics``, ``distributed`` and the ground (``errors``, ``system``,
``log``), never ``engine`` (``tests/unit/test_layers.py``).
"""
