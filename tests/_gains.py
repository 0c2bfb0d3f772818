"""The loss gains the tests build a criterion with: the config's default ``box``, ``cls`` and ``dfl``, read from
``detrain/config/keys.py`` (their one place; the model's loss takes whatever gains it is given)."""

from __future__ import annotations

from dataclasses import asdict

from detrain.config.keys import Loss
from detrain.nn.head import LossGains

DEFAULT_GAINS = LossGains(**asdict(Loss()))
