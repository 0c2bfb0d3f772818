"""Where an Ultralytics user already keeps datasets: the ``datasets_dir`` of Ultralytics' settings file.

A user who has trained with Ultralytics has ``coco8/``, ``coco128/`` ... under that folder. Before detrain
downloads a dataset whose files are missing, it looks there (:func:`detrain.data.dataset_yaml.load_dataset_yaml`)
and uses a complete copy, saying so in one line. The settings file is Ultralytics' own
(``$YOLO_CONFIG_DIR/Ultralytics/settings.json``, else the platform's user config folder, as Ultralytics picks it):
it is read only if it is a regular file of at most 1 MiB holding a JSON object whose ``datasets_dir`` is a
non-empty string; anything else (absent, a FIFO, too large, not JSON, another type) means "no such folder", never
an error, because the file is another program's and detrain only borrows a hint from it.

>>> import json; os.makedirs("cfg/Ultralytics")
>>> with open("cfg/Ultralytics/settings.json", "w") as f:
...     json.dump({"datasets_dir": "/data/datasets", "runs_dir": "/data/runs"}, f)
>>> os.environ["YOLO_CONFIG_DIR"] = "cfg"
>>> ultralytics_datasets_dir()
PosixPath('/data/datasets')
>>> with open("cfg/Ultralytics/settings.json", "w") as f:
...     json.dump({"datasets_dir": 3}, f)
>>> ultralytics_datasets_dir() is None
True
>>> del os.environ["YOLO_CONFIG_DIR"]
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

from detrain.system.input_file import UnreadableFile, read_input_text

MAX_SETTINGS_BYTES = 1 << 20  # Ultralytics' settings.json is about 1 KB


def ultralytics_settings_file() -> Path:
    """Ultralytics' settings.json: under ``$YOLO_CONFIG_DIR/Ultralytics`` when that is set, else the user config
    folder of this platform (Linux: ``$XDG_CONFIG_HOME`` or ``~/.config``)."""
    env = os.environ.get("YOLO_CONFIG_DIR")
    system = platform.system()
    if env:
        base = Path(env).expanduser()
    elif system == "Windows":
        base = Path.home() / "AppData" / "Roaming"
    elif system == "Darwin":
        base = Path.home() / "Library" / "Application Support"
    else:
        base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return base / "Ultralytics" / "settings.json"


def ultralytics_datasets_dir() -> Path | None:
    """The ``datasets_dir`` Ultralytics' settings file names, or None when there is no usable one."""
    try:
        settings = json.loads(read_input_text(ultralytics_settings_file(), MAX_SETTINGS_BYTES))
    except (OSError, UnreadableFile, ValueError, RecursionError):
        return None
    value = settings.get("datasets_dir") if isinstance(settings, dict) else None
    if not isinstance(value, str) or not value.strip() or "\0" in value:
        return None
    return Path(value).expanduser()
