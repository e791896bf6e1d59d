"""How big vllmini is: a plain line count of the engine, the course's tools, the emulator and the kernels.

    python scripts/code_size.py            # one line per part
    python scripts/code_size.py --by-file  # and every module of each part

The README's size sentence comes from this count (tests/test_project.py checks that it still holds).
"""

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# part -> the files it counts
PARTS = {
    "engine": lambda: sorted((ROOT / "vllmini").glob("*.py")),
    "course tools": lambda: sorted((ROOT / "vllmini" / "course").rglob("*.py")),
    "emulator (Python)": lambda: sorted((ROOT / "vllmini" / "emulator").rglob("*.py")),
    "emulator (C++ headers)": lambda: sorted((ROOT / "vllmini" / "emulator").rglob("*.h")),
    "kernels": lambda: sorted((ROOT / "kernels").rglob("*.cu")),
}


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def sizes() -> dict[str, dict[str, int]]:
    """part -> {file relative to the repository: lines}."""
    return {
        part: {p.relative_to(ROOT).as_posix(): lines(p) for p in files()} for part, files in PARTS.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--by-file", action="store_true", help="list every file of each part")
    args = parser.parse_args()
    for part, files in sizes().items():
        print(f"{part:24} {sum(files.values()):6,} lines in {len(files)} files")
        if args.by_file:
            for name, n in sorted(files.items(), key=lambda item: -item[1]):
                print(f"    {name:52} {n:5}")


if __name__ == "__main__":
    main()
