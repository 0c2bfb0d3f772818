"""Reading a ``cfg=FILE``: a yaml of keys (a run's args.yaml, or one a user wrote), as Ultralytics users rerun a
saved configuration. Only the file is read here, through the project's bounded yaml loader
(:mod:`detrain.system.safe_yaml`: no alias bombs, no device, no FIFO, at most :data:`MAX_CFG_BYTES`); what its
keys mean is :func:`detrain.config.cfg.make_cfg`'s to decide.

Every refusal is one :class:`~detrain.errors.ConfigError` line that names the file (an excerpt of its path) and
what is wrong, never more than a short escaped excerpt of what the file holds.

>>> with open("run.yaml", "w") as f:
...     _ = f.write("epochs: 3\\nimgsz: 320\\n")
>>> read_cfg_file("run.yaml")
('run.yaml', {'epochs': 3, 'imgsz': 320})
>>> read_cfg_file("missing.yaml")
Traceback (most recent call last):
...
detrain.errors.ConfigError: cfg=missing.yaml: file not found; give a yaml of keys, e.g. runs/train/exp/args.yaml
"""

from __future__ import annotations

import os
from typing import Any

from detrain.config.values import check_text, fail
from detrain.errors import ConfigError
from detrain.system.safe_yaml import YamlRefused, read_yaml
from detrain.system.text import excerpt, path_excerpt

# A file of keys is a few kilobytes (detrain's args.yaml: about 3 KB); one much larger is no configuration.
MAX_CFG_BYTES = 1 << 20
# No key's value is longer than a path (PATH_MAX): a longer one would only be quoted, whole, by later messages.
MAX_VALUE_CHARS = 4096
EXAMPLE = "runs/train/exp/args.yaml"


def cfg_path(value: Any) -> str:
    """The path a ``cfg=`` value names, checked as text (no control or invisible characters, not empty)."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value.strip():
        raise fail("cfg", value, f"a yaml file of keys, e.g. cfg={EXAMPLE}")
    check_text("cfg", value)
    return value


def read_cfg_file(value: Any) -> tuple[str, dict[str, Any]]:
    """(the path as messages show it, the file's keys and values as the yaml gives them); an empty file has no
    keys. Raises ConfigError for a path that is no readable regular yaml file of at most :data:`MAX_CFG_BYTES`,
    and for a document that is not a mapping."""
    path = cfg_path(value)
    name = path_excerpt(path, 80)
    try:
        document = read_yaml(path, MAX_CFG_BYTES)
    except FileNotFoundError:
        raise ConfigError(f"cfg={name}: file not found; give a yaml of keys, e.g. {EXAMPLE}") from None
    except YamlRefused as e:
        raise ConfigError(f"cfg={name}: {e}") from None
    if document is None:
        return name, {}
    if not isinstance(document, dict):
        raise ConfigError(
            f"cfg={name}: expected a yaml of key: value lines (as {EXAMPLE}), found a {type(document).__name__} "
            f"({excerpt(document, 40)})"
        )
    for key, item in document.items():
        if isinstance(item, str) and len(item) > MAX_VALUE_CHARS:
            raise ConfigError(
                f"cfg={name}: the value of {excerpt(key, 40)} is {len(item)} characters long "
                f"({excerpt(item, 40)}); no key takes more than {MAX_VALUE_CHARS}"
            )
    return name, document
