"""Regenerate the explorer screenshot shown in the README and in notebook 03 (notebooks/images/).

It runs the browser test (tests/test_browser.py: JupyterLab in headless Chromium, the explorer used
step by step, a screenshot after each step into tests/artifacts/explorer/) and copies the step that
shows the most — a fork after copy-on-write — next to the notebooks. The test itself never writes
outside its ignored artifacts folder.

    python scripts/explorer_screenshot.py          # needs chromium (apt-get install chromium) and playwright
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHOT = ROOT / "tests" / "artifacts" / "explorer" / "05_copy_on_write.png"
TARGET = ROOT / "notebooks" / "images" / "explorer.png"


def main() -> int:
    env = dict(os.environ, CI="1")  # a missing browser is an error here, not a skip
    test = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_browser.py"]
    if subprocess.run(test, cwd=ROOT, env=env).returncode != 0:
        print("the browser test failed: screenshot not updated", file=sys.stderr)
        return 1
    TARGET.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(SHOT, TARGET)
    print(f"wrote {TARGET.relative_to(ROOT)} from {SHOT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
