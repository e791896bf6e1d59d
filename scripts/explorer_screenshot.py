"""Regenerate the explorer screenshot shown in the README and in notebook 03 (notebooks/images/).

It runs the browser test (tests/test_browser.py: JupyterLab in headless Chromium, the explorer used
step by step, a screenshot after each step into tests/artifacts/explorer/) and copies the step that
shows the most next to the notebooks: three samples of one prompt right after a decode step, their
shared pages with three arrows each, the two copy-on-write pairs of the step highlighted, and a
finished request's pages cached but free; and the 1000-block explorer after a fork and a step. The
test itself never writes outside its ignored artifacts
folder.

    python scripts/explorer_screenshot.py          # needs chromium (apt-get install chromium) and playwright
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHOTS = ROOT / "tests" / "artifacts" / "explorer"
# the screenshots' names in the browser test (after their number) -> where they go
TARGETS = {
    "step_copies": ROOT / "notebooks" / "images" / "explorer.png",
    "big_pool": ROOT / "notebooks" / "images" / "explorer_1000.png",  # the 1000-block explorer
}


def main() -> int:
    env = dict(os.environ, CI="1")  # a missing browser is an error here, not a skip
    test = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_browser.py"]
    if subprocess.run(test, cwd=ROOT, env=env).returncode != 0:
        print("the browser test failed: screenshot not updated", file=sys.stderr)
        return 1
    for step, target in TARGETS.items():
        (shot,) = SHOTS.glob(f"[0-9][0-9]_{step}.png")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, target)
        print(f"wrote {target.relative_to(ROOT)} from {shot.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
