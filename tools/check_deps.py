#!/usr/bin/env python3
"""Does podsrl still pass its tests on the dependencies a user would get next month, or on the oldest it admits?

    python3 tools/check_deps.py --latest    # newest releases on the registry, upper bounds ignored
    python3 tools/check_deps.py --lowest    # the lower bound of every bounded dependency (its newest patch)

Builds a scratch virtual environment (nothing in the caller's changes), installs torch first (the README's CPU build; with --torch
the newest or lowest one admitted: PyPI's newest torch is a several-GB CUDA build), then podsrl with every extra,
prints each dependency's pyproject range beside the version installed and flags the ones outside it, then runs the
tests (default: everything not marked slow) and names the failures. Exit code: pytest's. A dependency that moved out
of its range and broke nothing is admitted by raising its bound in pyproject.toml, in the same commit as this
script's output in the message.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
TORCH_DEFAULT = "torch==2.13.0"  # the README's CPU build
GPU_ONLY_EXTRAS = ("vllm",)  # no CPU wheel (tests/engines/test_vllm_contract.py checks the calls with a fake module)
REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*(.*)$")


def requirements(pyproject: dict) -> list[str]:
    """The core dependencies and those of every extra but the GPU-only ones, each once (podsrl[...] self-references
    expanded)."""
    project = pyproject["project"]
    found = list(project["dependencies"])
    for name, extra in project.get("optional-dependencies", {}).items():
        if name not in GPU_ONLY_EXTRAS:
            found += [r for r in extra if not r.startswith("podsrl[")]
    seen, unique = set(), []
    for r in found:
        name = REQUIREMENT.match(r).group(1).lower()
        if name not in seen:
            seen.add(name)
            unique.append(r)
    return unique


def split(requirement: str) -> tuple[str, str, list[str]]:
    name, extras, spec = REQUIREMENT.match(requirement).groups()
    return name, extras or "", [c.strip() for c in spec.split(",") if c.strip()]


def target(requirement: str, mode: str) -> str:
    """What to install: `latest` drops upper bounds; `lowest` pins a bounded dependency's lower bound."""
    name, extras, clauses = split(requirement)
    lower = [c for c in clauses if c.startswith(">=")]
    upper = [c for c in clauses if c.startswith("<")]
    if mode == "latest":
        return name + extras + ",".join(c for c in clauses if not c.startswith("<"))
    if lower and upper:  # only the ranges podsrl states as tested
        return f"{name}{extras}=={lower[0][2:]}.*"
    return requirement


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=False, **kw)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--latest", action="store_const", dest="mode", const="latest")
    mode.add_argument("--lowest", action="store_const", dest="mode", const="lowest")
    parser.add_argument("--torch", action="store_true",
                        help=f"move torch too (default: {TORCH_DEFAULT}; PyPI's newest torch is a CUDA build)")
    parser.add_argument("--venv", type=Path, help="where to build the environment (default: a temporary folder)")
    parser.add_argument("pytest_args", nargs="*", default=["-m", "not slow"],
                        help="passed to pytest after '--' (default: -m 'not slow')")
    parser.set_defaults(mode="latest")
    args = parser.parse_args()

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    reqs = requirements(pyproject)
    torch_req = next(r for r in reqs if split(r)[0] == "torch")
    with tempfile.TemporaryDirectory() as scratch:
        venv = args.venv or Path(scratch) / "venv"
        if run([sys.executable, "-m", "venv", "--clear", str(venv)]).returncode:
            return 1
        python = str(venv / "bin" / "python")
        pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        torch = target(torch_req, args.mode) if args.torch else TORCH_DEFAULT
        others = [target(r, args.mode) for r in reqs if split(r)[0] != "torch"]
        if run(pip + [torch]).returncode or run(pip + ["--no-deps", "-e", str(ROOT)]).returncode:
            return 1
        if run(pip + others).returncode:
            print(f"check_deps: pip could not install the {args.mode} set together (see above)")
            return 1
        installed = dict(line.split("==", 1) for line in subprocess.run(
            [python, "-m", "pip", "freeze", "--exclude-editable"], capture_output=True, text=True, check=True
        ).stdout.splitlines() if "==" in line)
        installed = {k.lower().replace("_", "-"): v for k, v in installed.items()}
        moved = report(reqs, installed, python)
        result = run([python, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *args.pytest_args], cwd=ROOT)
        verdict = "passed" if result.returncode == 0 else f"FAILED (pytest exit {result.returncode})"
        print(f"check_deps --{args.mode}: tests {verdict}; outside pyproject's ranges: {', '.join(moved) or 'none'}")
        return result.returncode


def report(reqs: list[str], installed: dict[str, str], python: str) -> list[str]:
    """Prints range vs installed for every dependency; returns those installed outside their range."""
    check = (
        "import sys\nfrom packaging.specifiers import SpecifierSet\n"
        "for line in sys.stdin.read().splitlines():\n"
        "    spec, version = line.split('|')\n"
        "    print(version in SpecifierSet(spec, prereleases=True))\n"
    )
    rows = []
    for r in reqs:
        name, _, clauses = split(r)
        rows.append((name, ",".join(clauses), installed.get(name.lower().replace("_", "-"), "?")))
    answers = subprocess.run([python, "-c", check], input="\n".join(f"{s}|{v}" for _, s, v in rows),
                             capture_output=True, text=True, check=True).stdout.split()
    moved = []
    print(f"{'dependency':<16} {'pyproject':<20} installed")
    for (name, spec, version), inside in zip(rows, answers):
        flag = "" if inside == "True" else "   <- outside the range"
        if flag:
            moved.append(f"{name} {version}")
        print(f"{name:<16} {spec or '(any)':<20} {version}{flag}")
    return moved


if __name__ == "__main__":
    sys.exit(main())
