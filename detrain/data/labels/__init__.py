"""Labels of a split: every image and label file verified once (``verify``, ``check``), cached
(``cache``) into :class:`LabelRecord` s (``record``); which labels a run keeps (``class_filter``) and the ground
truth and COCO ids the validator and COCO json use (``ground_truth``).
"""
