"""The bundled presets (podsrl/configs/*.yaml): finding one by name, and each one's purpose for `podsrl presets`.

A preset's purpose is the first sentence of the comment block at its top, so the file stays its own documentation.
"""

from __future__ import annotations

from pathlib import Path

from podsrl.errors import UserError

PRESET_DIR = Path(__file__).parents[1] / "configs"
PURPOSE_CHARS = 120  # about one terminal line with the name in front


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def preset_path(name: str, option: str = "--config") -> Path:
    """A bundled preset by name (e.g. 'grpo'), or a path to a YAML file; `option` names the argument in errors."""
    path = Path(name)
    if path.suffix in (".yaml", ".yml") or path.exists():
        return path
    bundled = PRESET_DIR / f"{name}.yaml"
    if bundled.is_file():
        return bundled
    raise UserError(f"{option}: no file {name!r} and no bundled preset of that name; presets: "
                    f"{', '.join(preset_names())} (`podsrl presets` says what each is for)")


def purpose(path: Path) -> str:
    """The first sentence of the file's leading comment block; a long one is cut to the clause before its first
    colon (the presets' comments say what the run is, then ": the details")."""
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    text = " ".join(lines)
    end = text.find(". ")
    text = text[: end + 1] if end >= 0 else text
    if len(text) > PURPOSE_CHARS and ": " in text:
        text = text.split(": ", 1)[0]
    return text or "(no description: the file has no leading comment)"


def preset_table() -> str:
    """One line per bundled preset: name, then purpose."""
    names = preset_names()
    width = max(map(len, names))
    return "\n".join(f"{name:<{width}}  {purpose(PRESET_DIR / f'{name}.yaml')}" for name in names)
