#!/usr/bin/env python3
"""Does the fake `vllm` of the contract test (tests/engines/fake_vllm.py) still have the signatures of the vLLM release
that pyproject's `vllm` extra admits?

    python3 tools/check_vllm_contract.py                 # the newest release inside the extra's range
    python3 tools/check_vllm_contract.py --version 0.33.0
    python3 tools/check_vllm_contract.py --wheel vllm-0.33.0-....whl

Downloads that release's wheel (`pip download --no-deps`, ~340 MB; vLLM publishes no sdist small enough to prefer)
and reads the source files it needs from it as text (ast; vLLM is never imported, so this runs on any machine).
Compared, each against the fake's own source:
- the parameters (kind, name, default) of `LLM.__init__`, `LLM.generate`, `LLM.collective_rpc`,
  `LLM.reset_prefix_cache`, `LLM.sleep`, `LLM.wake_up`, and of the model runner's `reload_weights` (the worker's
  forwards `*args, **kwargs` to it) against the fake worker's;
- `SamplingParams`' fields in order with their defaults (a default naming one of vLLM's own types, such as
  `RequestOutputKind.CUMULATIVE`, may be `None` in the fake, which has no such type);
- `EngineArgs`' fields against the fake's ENGINE_ARGS (the keywords `LLM(**kwargs)` accepts);
- `Logprob`, `CompletionOutput` and `RequestOutput`: each field of the fake's is one of vLLM's.
Exit code 1 when anything differs (each difference printed), 0 when the fake matches.
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
FAKE = ROOT / "tests" / "engines" / "fake_vllm.py"

# (fake class.function, vLLM file, vLLM class.function)
SIGNATURES = [
    ("LLM.__init__", "vllm/entrypoints/llm.py", "LLM.__init__"),
    ("LLM.generate", "vllm/entrypoints/llm.py", "LLM.generate"),
    ("LLM.collective_rpc", "vllm/entrypoints/llm.py", "LLM.collective_rpc"),
    ("LLM.reset_prefix_cache", "vllm/entrypoints/llm.py", "LLM.reset_prefix_cache"),
    ("LLM.sleep", "vllm/entrypoints/llm.py", "LLM.sleep"),
    ("LLM.wake_up", "vllm/entrypoints/llm.py", "LLM.wake_up"),
    ("Worker.reload_weights", "vllm/v1/worker/gpu_model_runner.py", "GPUModelRunner.reload_weights"),
]
# (fake class, vLLM file, vLLM class): every field of the fake's is one of vLLM's
FIELD_SUBSETS = [
    ("Logprob", "vllm/logprobs.py", "Logprob"),
    ("CompletionOutput", "vllm/outputs.py", "CompletionOutput"),
    ("RequestOutput", "vllm/outputs.py", "RequestOutput"),
]


def find_class(tree: ast.Module, name: str) -> ast.ClassDef:
    found = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)
    if found is None:
        raise LookupError(f"class {name} not found")
    return found


def find_function(tree: ast.Module, qualified: str) -> ast.FunctionDef:
    cls, name = qualified.split(".")
    found = next((n for n in find_class(tree, cls).body if isinstance(n, ast.FunctionDef) and n.name == name), None)
    if found is None:
        raise LookupError(f"{qualified} not found")
    return found


def parameters(function: ast.FunctionDef) -> list[tuple[str, str, str]]:
    """(kind, name, default source or '') of each parameter but self, in order."""
    a = function.args
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    out = [("positional-only" if p in a.posonlyargs else "positional", p.arg, source(d))
           for p, d in zip(positional, defaults)]
    if a.vararg:
        out.append(("*args", a.vararg.arg, ""))
    out += [("keyword-only", p.arg, source(d)) for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        out.append(("**kwargs", a.kwarg.arg, ""))
    return [p for p in out if p[1] != "self"]


def source(node: ast.AST | None) -> str:
    return "" if node is None else re.sub(r"\bmsgspec\.field\(", "field(", ast.unparse(node))


def fields(cls: ast.ClassDef) -> list[tuple[str, str, ast.AST | None]]:
    """(name, default source, default node) of a dataclass/struct's annotated fields, in order; a plain class's
    __init__ parameters when it declares none."""
    found = [(n.target.id, source(n.value), n.value) for n in cls.body
             if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
    if found:
        return found
    init = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    return [(name, default, None) for _, name, default in parameters(init)] if init else []


def engine_args_in_fake(fake: ast.Module) -> set[str]:
    for node in fake.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "ENGINE_ARGS" for t in node.targets):
            text = next(c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant) and isinstance(c.value, str))
            return set(text.split())
    raise LookupError("ENGINE_ARGS not found in the fake")


def compare(fake: ast.Module, read) -> list[str]:
    """Every difference between the fake's source and vLLM's (read(path) -> that file's AST)."""
    problems = []
    for fake_name, path, real_name in SIGNATURES:
        ours, theirs = parameters(find_function(fake, fake_name)), parameters(find_function(read(path), real_name))
        if ours != theirs:
            problems.append(f"{fake_name} vs {path}:{real_name}:\n    fake: {ours}\n    vLLM: {theirs}")
    ours = fields(find_class(fake, "SamplingParams"))
    theirs = fields(find_class(read("vllm/sampling_params.py"), "SamplingParams"))
    if [n for n, _, _ in ours] != [n for n, _, _ in theirs]:
        problems.append(f"SamplingParams' fields:\n    fake: {[n for n, _, _ in ours]}\n"
                        f"    vLLM: {[n for n, _, _ in theirs]}")
    else:
        for (name, mine, _), (_, real, node) in zip(ours, theirs):
            stand_in = mine == "None" and isinstance(node, ast.Attribute)  # a value of vLLM's own types
            if mine != real and not stand_in:
                problems.append(f"SamplingParams.{name}'s default: fake {mine}, vLLM {real}")
    engine_fields = {n for n, _, _ in fields(find_class(read("vllm/engine/arg_utils.py"), "EngineArgs"))}
    ours_only, theirs_only = engine_args_in_fake(fake) - engine_fields, engine_fields - engine_args_in_fake(fake)
    if ours_only or theirs_only:
        problems.append(f"EngineArgs' fields: only in the fake {sorted(ours_only)}, only in vLLM {sorted(theirs_only)}")
    for fake_name, path, real_name in FIELD_SUBSETS:
        missing = {n for n, _, _ in fields(find_class(fake, fake_name))} - {
            n for n, _, _ in fields(find_class(read(path), real_name))}
        if missing:
            problems.append(f"{fake_name}: fields vLLM's {path}:{real_name} does not have: {sorted(missing)}")
    return problems


def admitted_range() -> str:
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["vllm"]
    return next(r for r in extra if r.startswith("vllm"))


def download(requirement: str, into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
           "--only-binary", ":all:", "--python-version", "3.12", "--platform", "manylinux_2_28_x86_64",
           "-d", str(into), requirement]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return next(into.glob("vllm-*.whl"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--version", help="a vLLM release (default: the newest inside pyproject's vllm extra)")
    which.add_argument("--wheel", type=Path, help="a vLLM wheel already downloaded")
    args = parser.parse_args()

    fake = ast.parse(FAKE.read_text())
    fake_version = next(n.value.value for n in fake.body if isinstance(n, ast.Assign)
                        and getattr(n.targets[0], "id", "") == "__version__")
    with tempfile.TemporaryDirectory() as scratch:
        wheel = args.wheel or download(f"vllm=={args.version}" if args.version else admitted_range(), Path(scratch))
        with zipfile.ZipFile(wheel) as archive:
            real_version = re.match(r"vllm-([^-]+)-", wheel.name).group(1)
            problems = compare(fake, lambda path: ast.parse(archive.read(path).decode()))
    print(f"check_vllm_contract: pyproject's extra {admitted_range()!r}; the fake says vLLM {fake_version}; "
          f"checked against {wheel.name}")
    if fake_version != real_version:
        problems.append(f"the fake's __version__ is {fake_version}, the release checked is {real_version}")
    for problem in problems:
        print("DRIFT:", problem)
    checked = len(SIGNATURES) + 2 + len(FIELD_SUBSETS)
    print(f"check_vllm_contract: {checked} checks, {len(problems)} difference(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
