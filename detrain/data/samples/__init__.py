"""The training-sample pipeline: one augmented sample planned (every random draw, no pixels) and
rendered (``train_sample``) from its steps: mosaic layout, affine geometry, composition of tiles, CutMix, the HSV
colour step and letterbox (``augment``), with the boxes of an image in flight (``instances``).
"""
