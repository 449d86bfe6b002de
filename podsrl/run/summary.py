"""What a run that spent its budget leaves beside its metrics: summary.json (where it ended, its last eval, the
compute it used, its health warnings, the checkpoints a resume skipped, the tokenizer its token counts count and the
engine that really sampled), LoRA's merged model and the plots."""

from __future__ import annotations

import json
from pathlib import Path

from podsrl.config import Config
from podsrl.fileio import write_text_atomic
from podsrl.reporting.plotting import plot_run
from podsrl.run.assembly import RunParts
from podsrl.run.description import tokenizer_identity


def run_summary(cfg: Config, parts: RunParts, step: int, elapsed: float, last_eval: dict,
                health_warnings: list[dict]) -> dict:
    return {"step": step, "time/elapsed": elapsed, **last_eval,
            **parts.accountant.total_metrics(), "health_warnings": health_warnings,
            "skipped_checkpoints": parts.skipped_checkpoints,
            "tokenizer": tokenizer_identity(parts.tokenizer, cfg.model.name_or_path),
            # the engine that really sampled, and why it is not the one configured (null: it is)
            "engine": parts.engine.sampler, "engine/fallback": parts.engine.fallback_reason}


def write_run_outputs(cfg: Config, parts: RunParts, run_dir: Path, summary: dict) -> None:
    """The main rank's: LoRA's merged model (model.lora_rank > 0), summary.json and the plots (log.plot)."""
    if cfg.model.lora_rank > 0:
        from podsrl.lora import export_merged

        export_merged(parts.generation_model, run_dir / "merged", parts.tokenizer)
    write_text_atomic(run_dir / "summary.json", json.dumps(summary, indent=1))
    if cfg.log.plot:
        plot_run(run_dir)
