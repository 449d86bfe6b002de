"""Which tokenizer each config of a comparison counts its tokens in: token counts of different tokenizers are not
one unit (a character-level tokenizer's 'tokens' are characters, a BPE's are pieces of words), so a comparison
names each config's tokenizer and flags its token columns where they differ."""

from __future__ import annotations

import logging

log = logging.getLogger("podsrl")


def run_tokenizer(summary: dict | None, config: dict) -> dict:
    """A run's tokenizer as its summary.json records it ({name, vocab_size, digest}); for an unfinished run (no
    summary yet) or one of an older version, what its config.yaml names (model.name_or_path) alone."""
    recorded = (summary or {}).get("tokenizer")
    if isinstance(recorded, dict) and "digest" in recorded:
        return recorded
    model = config.get("model") or {}
    name = model.get("name_or_path", "tiny") if isinstance(model, dict) else "tiny"
    return {"name": str(name), "vocab_size": None, "digest": None}


def _key(tokenizer: dict) -> str:
    return tokenizer["digest"] or tokenizer["name"]


def _describe(tokenizer: dict) -> str:
    if tokenizer["digest"] is None:
        return f"{tokenizer['name']} (as configured; the run records no digest)"
    return f"{tokenizer['name']} (vocabulary {tokenizer['vocab_size']}, digest {tokenizer['digest']})"


def tokenizer_note(configs: dict[str, list[dict]]) -> tuple[str, bool]:
    """A markdown paragraph naming each config's tokenizer(s) ({label: [its runs' tokenizers]}), and whether their
    token counts differ in unit; a warning is logged once when they do."""
    per_config = {label: list({_key(t): t for t in runs}.values()) for label, runs in configs.items()}
    keys = {_key(t) for tokenizers in per_config.values() for t in tokenizers}
    names = "; ".join(f"`{label}`: " + ", ".join(_describe(t) for t in tokenizers)
                      for label, tokenizers in per_config.items())
    if len(keys) <= 1:
        return f"Tokenizer (token counts are in its tokens): {names}.\n", False
    log.warning("the configs compared count tokens with different tokenizers (%s): their token counts are not one "
                "unit and are flagged in results.md", names)
    return (f"**Token counts are not comparable across these configs: they count different tokenizers' tokens.** "
            f"Tokenizers: {names}. Compare rollouts, accuracy and time instead.\n"), True
