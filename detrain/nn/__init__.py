"""The model and its math: layers (``modules``), the yaml -> model builder (``yaml_plan``, ``model``), the heads
(``head``: what may be asked of one, the registry that finds it by its yaml name, the loss template; ``Detect`` in
``modules``, ``head_e2e``), size and cost (``info``), box geometry (``boxes``), the assigner and losses the heads
train with (``assigner``, ``loss``, ``loss_e2e``) and their postprocess (``postprocess``, ``topk_decode``). Imports
the ground (``errors``, ``system``, ``log``) and, of the config, only the loss section's default gains: the model is
built from plain values, never from a ``Cfg`` (``tests/unit/test_layers.py``).
"""
