"""``python -m tetrad.calibrate [options]``: the same as ``tetrad calibrate [options]``."""

import sys

from tetrad.cli import main

sys.exit(main(["calibrate", *sys.argv[1:]]))
