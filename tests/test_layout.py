"""tests/ mirrors the package: every folder of podsrl/ that is a package has a tests/ folder of the same name, so the
tests of a module are found where its code is (the faults, journeys and distributed folders cut across packages)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_has_its_tests_folder():
    packages = {p.parent.name for p in (ROOT / "podsrl").glob("*/__init__.py")}
    missing = sorted(name for name in packages if not (ROOT / "tests" / name / "__init__.py").is_file())
    assert packages and not missing, f"podsrl/ packages without a tests/<name>/ folder: {missing}"
