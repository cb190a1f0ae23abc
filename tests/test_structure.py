"""The package's shape: the planner and configuration work without torch; modules stay short."""

import subprocess
import sys
from pathlib import Path

import tetrad

PACKAGE = Path(tetrad.__file__).parent

HIDE_TORCH = """
import sys

class Hidden:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "numpy"):
            raise ImportError(f"{name} is hidden in this test")

sys.meta_path.insert(0, Hidden())
"""


def test_planner_and_config_import_without_torch():
    code = HIDE_TORCH + (
        "import tetrad.plan, tetrad.train.config, tetrad.spec\n"
        "import tetrad.plan.cli, tetrad.plan.search, tetrad.plan.report, tetrad.plan.comm\n"
        "from tetrad.train.config import load_config\n"
        "cfg = load_config(None, {'model': 'tiny', 'grid': '1,1,2,2', 'steps': 4})\n"
        "cfg.check()\n"
        "assert cfg.model_config(4096).vocab_size == 4096\n"
        "import tetrad.cli\n"
        "assert tetrad.cli.main(['memory', '--model', 'llama-1b', '--grid', '1,1,2,2']) == 0\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_modules_are_short():
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 400
    }
    assert not long, f"modules over 400 lines: {long}"
