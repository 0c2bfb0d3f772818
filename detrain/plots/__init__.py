"""Every picture detrain draws: boxes and labels on an image (``annotate``, coloured by ``palette``), the
validation curves, confusion matrix and batch pictures (``val``), and training's batch pictures and results.png
(``train``). Imports ``metrics``, ``nn.boxes`` and ``log``; only rank 0 calls it.
"""
