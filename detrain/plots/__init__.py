"""Every picture detrain draws: boxes and labels on an image (``annotate``, coloured by ``palette``), the
validation curves, confusion matrix and batch pictures (``val``), and training's batch pictures, results.png and
labels.jpg (``train``). Imports ``metrics``, ``nn.boxes`` and ``log``; only rank 0 calls it.
"""
