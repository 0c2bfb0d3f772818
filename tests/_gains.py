"""The loss gains the tests build a criterion with: the config's default ``box``, ``cls`` and ``dfl``, read from
``detrain/config/keys.py`` (their one place; the model's loss takes whatever gains it is given). ``DEFAULT_LOSS`` is
the loss section as the trainer hands it to ``DetectionModel.criterion`` (a mapping); ``DEFAULT_GAINS`` the YOLO
losses' own form of it."""

from __future__ import annotations

from dataclasses import asdict
from types import MappingProxyType

from detrain.config.keys import Loss
from detrain.nn.loss import LossGains

DEFAULT_LOSS = MappingProxyType(asdict(Loss()))
DEFAULT_GAINS = LossGains(**DEFAULT_LOSS)
