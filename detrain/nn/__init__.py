"""The model and its math: layers (``modules``), the yaml -> model builder (``model``), size and cost
(``info``), box geometry (``boxes``), the assigner and loss the model trains with (``assigner``, ``loss``) and
its postprocess (``postprocess``: decode and NMS). Imports only ``errors``, ``config`` and ``system``.
"""
