#!/usr/bin/env python3
"""Does podsrl still pass its tests on the dependencies a user would get next month, on the oldest it admits, or on
any (torch, transformers) corner of its ranges?

    python3 tools/check_deps.py --latest    # newest releases on the registry, upper bounds ignored
    python3 tools/check_deps.py --lowest    # the lower bound of every bounded dependency (its newest patch)
    python3 tools/check_deps.py --corner torch==2.13.0,transformers==5.17.0 \\
                                --corner torch==2.14.1,transformers==5.24.0 --workers 2 -- tests/engines

Builds a scratch virtual environment per run (nothing in the caller's changes): torch first (the README's CPU
build; with --torch the newest or lowest one admitted: PyPI's torch is a several-GB CUDA build; a corner names its
own), then podsrl without its dependencies, then every other dependency of every extra but the GPU-only ones, with
a corner's pins in place of their ranges. It prints each dependency's pyproject range beside the version installed
(flagging the ones outside it), runs the tests (default: everything not marked slow; after `--`, a subset or other
pytest arguments) and, at the end, one table row per run: the versions, passed / failed / skipped, pytest's exit
code. Exit code: 0 when every run passed. A dependency that moved out of its range and broke nothing is admitted
by raising its bound in pyproject.toml, with this script's table in docs/results.md.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
TORCH_DEFAULT = "torch==2.13.0"  # the README's CPU build
GPU_ONLY_EXTRAS = ("vllm",)  # no CPU wheel (tests/engines/test_vllm_contract.py checks the calls with a fake module)
SHOWN = ("torch", "transformers", "peft", "trl")  # the versions a table row names
REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*(.*)$")


@dataclass
class Outcome:
    label: str
    versions: dict[str, str]
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    exit_code: int = 1
    note: str = ""


def canonical(name: str) -> str:
    return name.lower().replace("_", "-")


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
        name = canonical(REQUIREMENT.match(r).group(1))
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
    if mode == "lowest" and lower and upper:  # only the ranges podsrl states as tested
        return f"{name}{extras}=={lower[0][2:]}.*"
    return requirement


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=False, **kw)


def corner_pins(text: str) -> dict[str, str]:
    """'torch==2.13.0,transformers==5.17.0' -> {'torch': 'torch==2.13.0', 'transformers': ...}."""
    pins = {}
    for pin in filter(None, (p.strip() for p in text.split(","))):
        if "==" not in pin:
            raise SystemExit(f"check_deps: --corner {text!r}: {pin!r} is not 'name==version'")
        pins[canonical(split(pin)[0])] = pin
    return pins


def install_set(reqs: list[str], mode: str, move_torch: bool, pins: dict[str, str]) -> tuple[str, list[str]]:
    """(torch's requirement, every other requirement) for one run."""
    torch_req = next(r for r in reqs if split(r)[0] == "torch")
    torch = pins.get("torch") or (target(torch_req, mode) if move_torch else TORCH_DEFAULT)
    others = [pins.get(canonical(split(r)[0])) or target(r, mode) for r in reqs if split(r)[0] != "torch"]
    others += [pin for name, pin in pins.items() if name != "torch" and name not in
               {canonical(split(r)[0]) for r in reqs}]
    return torch, others


def build_and_test(label: str, venv: Path, torch: str, others: list[str], reqs: list[str],
                   pytest_args: list[str]) -> Outcome:
    print(f"\n=== check_deps: {label} ===", flush=True)
    if run([sys.executable, "-m", "venv", "--clear", str(venv)]).returncode:
        return Outcome(label, {}, note="venv failed")
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    if run(pip + [torch]).returncode or run(pip + ["--no-deps", "-e", str(ROOT)]).returncode:
        return Outcome(label, {}, note=f"pip could not install {torch} or podsrl")
    if run(pip + others).returncode:
        return Outcome(label, {}, note="pip could not install the set together (see above)")
    installed = dict(line.split("==", 1) for line in subprocess.run(
        [python, "-m", "pip", "freeze", "--exclude-editable"], capture_output=True, text=True, check=True
    ).stdout.splitlines() if "==" in line)
    installed = {canonical(k): v for k, v in installed.items()}
    moved = report(reqs, installed, python)
    junit = venv / "junit.xml"
    result = run([python, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", f"--junitxml={junit}",
                  *pytest_args], cwd=ROOT)
    outcome = Outcome(label, {n: installed.get(n, "-") for n in SHOWN}, exit_code=result.returncode,
                      note=f"outside pyproject: {', '.join(moved)}" if moved else "")
    if junit.is_file():
        suites = ElementTree.parse(junit).getroot().iter("testsuite")
        for suite in suites:
            total, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
            failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
            outcome.passed += total - skipped - failed
            outcome.failed += failed
            outcome.skipped += skipped
    return outcome


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--latest", action="store_const", dest="mode", const="latest")
    mode.add_argument("--lowest", action="store_const", dest="mode", const="lowest")
    mode.add_argument("--corner", action="append", metavar="PINS",
                      help="one run per --corner, e.g. torch==2.13.0,transformers==5.17.0 (the other dependencies "
                           "take their newest release inside pyproject's range)")
    parser.add_argument("--torch", action="store_true",
                        help=f"move torch too (default: {TORCH_DEFAULT}; PyPI's torch is a CUDA build)")
    parser.add_argument("--workers", type=int, default=0,
                        help="run the tests in N processes (installs pytest-xdist into each environment)")
    parser.add_argument("--venv", type=Path,
                        help="folder to build the environments in, kept afterwards (default: a temporary folder)")
    parser.add_argument("pytest_args", nargs="*", default=["-m", "not slow"],
                        help="passed to pytest after '--' (default: -m 'not slow')")
    parser.set_defaults(mode="latest")
    args = parser.parse_args()

    reqs = requirements(tomllib.loads((ROOT / "pyproject.toml").read_text()))
    if args.corner:
        runs = [(c, "range", corner_pins(c)) for c in args.corner]
    else:
        runs = [(f"--{args.mode}", args.mode, {})]
    outcomes = []
    with tempfile.TemporaryDirectory() as scratch:
        root = args.venv or Path(scratch)
        for i, (label, mode, pins) in enumerate(runs):
            torch, others = install_set(reqs, mode, args.torch, pins)
            workers = ["-n", str(args.workers)] if args.workers else []
            others += ["pytest-xdist"] if args.workers else []
            outcomes.append(build_and_test(label, root / f"venv{i}", torch, others, reqs,
                                           workers + args.pytest_args))
    print(table(outcomes, args.pytest_args))
    return 0 if all(o.exit_code == 0 for o in outcomes) else 1


def table(outcomes: list[Outcome], pytest_args: list[str]) -> str:
    lines = [f"check_deps: pytest {' '.join(pytest_args)}",
             "| run | " + " | ".join(SHOWN) + " | passed | failed | skipped | pytest exit | note |",
             "|---" * (len(SHOWN) + 6) + "|"]
    for o in outcomes:
        versions = " | ".join(o.versions.get(n, "-") for n in SHOWN)
        lines.append(f"| {o.label} | {versions} | {o.passed} | {o.failed} | {o.skipped} | {o.exit_code} | {o.note} |")
    return "\n".join(lines)


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
        rows.append((name, ",".join(clauses), installed.get(canonical(name), "?")))
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
