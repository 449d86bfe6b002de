"""The warm-up shipped with the package (podsrl/warmups/<key>): it is the default run's, under the key the current
code computes, with the shapes the current built-in model has, and runs start from it on any machine unless
warmup.shipped is false; `podsrl warmup` builds this machine's own."""

import json

import torch
from safetensors.torch import load_file

from podsrl.config import load_config
from podsrl.models.loading import build_char_tokenizer, build_tiny_model
from podsrl.run.warmup import SHIPPED, run_warmup, warmup_key, warmup_path


def test_the_shipped_warmup_is_the_default_runs_under_the_current_key():
    cfg = load_config(None)
    assert [p.name for p in SHIPPED.iterdir() if p.is_dir()] == [warmup_key(cfg)]  # one, and not a stale key
    shipped = SHIPPED / warmup_key(cfg)
    weights = load_file(shipped / "model.safetensors")
    expected = build_tiny_model(cfg.model.tiny, build_char_tokenizer(), seed=0).state_dict()
    # tied embeddings are saved once
    assert {k: tuple(v.shape) for k, v in weights.items()} == {
        k: tuple(v.shape) for k, v in expected.items() if k in weights}
    assert set(expected) - set(weights) <= {"lm_head.weight"}
    assert all(v.dtype == torch.float32 and torch.isfinite(v).all() for v in weights.values())
    record = json.loads((shipped / "warmup.json").read_text())
    assert cfg.warmup.target_accuracy <= record["validation_accuracy"] < 0.5 and record["steps"] <= cfg.warmup.steps


def test_runs_start_from_the_shipped_warmup_unless_told_otherwise(tmp_path):
    cfg = load_config(None, [f"warmup.cache_dir={tmp_path}"])
    assert run_warmup(cfg) == SHIPPED / warmup_key(cfg)
    own = warmup_path(cfg)  # this machine's own, as `podsrl warmup` leaves it (a stand-in: only its config.json)
    own.mkdir(parents=True)
    (own / "config.json").write_text("{}")
    assert run_warmup(cfg, use_shipped=False) == own
    off = load_config(None, [f"warmup.cache_dir={tmp_path}", "warmup.shipped=false"])
    assert warmup_key(off) == warmup_key(cfg) and run_warmup(off) == own
