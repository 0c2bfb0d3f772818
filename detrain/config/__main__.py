"""``python -m detrain.config``: write (or ``--check``) ``cfg/default.yaml`` from the declared keys."""

import sys

from detrain.config.default_yaml import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
