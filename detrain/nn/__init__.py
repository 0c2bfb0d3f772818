"""The model and its math: layers (``modules``), the yaml -> model builder (``model``), size and cost
(``info``), box geometry (``boxes``), the assigner and loss the model trains with (``assigner``, ``loss``) and
its postprocess (``postprocess``: decode and NMS). Imports only the ground (``errors``, ``system``, ``log``):
the model is built from plain values, never from a ``Cfg`` (``tests/unit/test_layers.py``).
"""
