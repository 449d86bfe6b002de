"""Loading the policy: the built-in tiny char-level Qwen2, or any Hugging Face causal LM (local path or hub id)."""

from __future__ import annotations

import json
import logging
import string
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2Tokenizer,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode

from podsrl.errors import UserError

if TYPE_CHECKING:  # the config is only read here: models/ stand below config/
    from podsrl.config import ModelConfig, TinyModelConfig

log = logging.getLogger("podsrl")

try:
    from safetensors import SafetensorError
except ImportError:  # older safetensors: its errors are OSError/RuntimeError subclasses, caught as such
    class SafetensorError(Exception):  # type: ignore[no-redef]
        pass

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
# Printable ASCII plus newline: enough for the built-in tasks and for plain-text datasets on the tiny model.
CHARS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
TINY_VOCAB_SIZE = 128  # >= 3 specials + len(CHARS); a round size for the embedding matmul


def build_char_tokenizer() -> Qwen2Tokenizer:
    """A character-level tokenizer: a byte-level BPE with no merges, so each character is one token.

    It is a Qwen2Tokenizer as the built-in model is a Qwen2: transformers' AutoTokenizer rebuilds a saved qwen2
    checkpoint's tokenizer as a Qwen2Tokenizer from its vocabulary and merges alone, so only a tokenizer that is one
    reloads with the same ids (spaces included). Ids are those of the earlier WordLevel tokenizer (specials, then
    CHARS in order); a character outside CHARS has no token and is dropped, as Qwen2Tokenizer drops unknown bytes."""
    to_unicode = bytes_to_unicode()  # byte-level BPE spells ' ' as 'Ġ' and '\n' as 'Ċ'
    vocab = {PAD: 0, EOS: 1, UNK: 2}
    for c in CHARS:
        vocab[to_unicode[ord(c)]] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=UNK, eos_token=EOS, pad_token=PAD, bos_token=None)
    tokenizer.padding_side = "left"
    return tokenizer


def build_tiny_model(cfg: TinyModelConfig, tokenizer: PreTrainedTokenizerFast, seed: int = 0) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=max(1, cfg.num_heads // 2),
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def load_tiny_at_context(path: str | Path, max_position_embeddings: int) -> Qwen2ForCausalLM:
    """A saved built-in model's weights with another context length: its positions are rotary, not weights."""
    return Qwen2ForCausalLM.from_pretrained(path, max_position_embeddings=max_position_embeddings)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(name)
    except RuntimeError:
        raise UserError(f"model.device: unknown device {name!r}") from None


def load_pretrained(path_or_id: str, dtype: str = "float32", trust_remote_code: bool = False):
    """(model, tokenizer) from a local directory or a hub id, with one clear error when that is impossible."""
    local = Path(path_or_id).expanduser()
    looks_local = local.exists() or path_or_id.startswith((".", "/", "~"))
    if looks_local and not (local / "config.json").is_file():
        raise UserError(f"model.name_or_path: {path_or_id!r} is not a model directory (no config.json in it)")
    try:
        tokenizer = load_tokenizer(str(local) if looks_local else path_or_id, trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            str(local) if looks_local else path_or_id,
            dtype=getattr(torch, dtype),
            trust_remote_code=trust_remote_code,
        )
    except SafetensorError as e:
        raise UserError(damaged_weights(local, e)) from None
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        where = "local path" if looks_local else "hub id (offline, or no such repo?)"
        raise UserError(f"model.name_or_path: cannot load {path_or_id!r} as a {where}: {first}") from None
    return model, tokenizer


def damaged_weights(directory: Path, error: Exception) -> str:
    """One line for a model directory whose weights do not load: the damaged file (the first whose header does
    not read back) and what to do, which depends on whose directory it is."""
    from safetensors import safe_open

    def unreadable(path: Path) -> bool:
        try:
            with safe_open(str(path), framework="pt"):
                return False
        except (SafetensorError, OSError):
            return True

    bad = next((f for f in sorted(directory.glob("*.safetensors")) if unreadable(f)), directory)
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if (directory / "warmup.json").is_file():
        advice = f"it is a cached warm-up: delete {directory} and the next run (or `podsrl warmup`) trains it again"
    elif (directory.parent / "manifest.json").is_file():  # a run's checkpoint (podsrl/run/checkpoint.py)
        advice = ("it is a run's checkpoint: use an older one (`podsrl train --resume` skips a damaged checkpoint "
                  "for the newest intact one)")
    else:
        advice = "restore or re-download the model"
    return f"{bad}: damaged weights ({reason}); {advice}"


def load_tokenizer(path_or_id: str, trust_remote_code: bool = False):
    """The model's tokenizer, padding on the left (with the end-of-sequence token when it has no pad token)."""
    tokenizer = AutoTokenizer.from_pretrained(path_or_id, trust_remote_code=trust_remote_code)
    written = _saved_tokenizer_model(path_or_id)
    if written is not None and written != type(tokenizer.backend_tokenizer.model).__name__:
        # AutoTokenizer rebuilt the saved tokenizer.json as the model type's class with another model (a checkpoint
        # of the built-in model from before its tokenizer was a byte-level BPE is WordLevel): read the file as written
        log.info("tokenizer: %s holds a %s tokenizer.json; loaded as written, not as %s", path_or_id, written,
                 type(tokenizer).__name__)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(path_or_id)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def _saved_tokenizer_model(path_or_id: str) -> str | None:
    """The model type ('BPE', 'WordLevel', ...) of a local directory's tokenizer.json; None without one."""
    path = Path(path_or_id).expanduser() / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))["model"]["type"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_policy(cfg: ModelConfig, base_path: str | None = None, seed: int = 0):
    """The policy and tokenizer: `base_path` (e.g. a cached warm-up) wins over cfg.name_or_path."""
    if base_path is not None:
        return load_pretrained(base_path, cfg.dtype, cfg.trust_remote_code)
    if cfg.name_or_path == "tiny":
        tokenizer = build_char_tokenizer()
        return build_tiny_model(cfg.tiny, tokenizer, seed).to(getattr(torch, cfg.dtype)), tokenizer
    return load_pretrained(cfg.name_or_path, cfg.dtype, cfg.trust_remote_code)


def count_parameters(model: torch.nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
