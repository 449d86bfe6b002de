"""The complete example tracker of docs/architecture.md, read from the page (so the two cannot drift): one file plus
one registry line, registered as written; a loaded config names it in log.report_to and a run's logger, resumed once,
writes its rows through it."""

from __future__ import annotations

import csv
import importlib.util
import re
import sys
from pathlib import Path

import pytest

from podsrl.config import ConfigError, load_config
from podsrl.reporting import trackers
from podsrl.reporting.tracking import build_metrics_logger, normalize_report_to

ROOT = Path(__file__).parents[2]


def doc_example() -> tuple[str, str]:
    """(the module's source, the registry line) from the page's "How to add a tracker" section."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text[text.index("## How to add a tracker"):]
    module, line = re.findall(r"```python\n(.*?)```", section, re.DOTALL)[:2]
    return module, line.strip()


@pytest.fixture
def registered(tmp_path, monkeypatch):
    """The example registered as its page says: its module under podsrl.reporting.trackers, its line in TRACKERS."""
    module, line = doc_example()
    source = tmp_path / "csv_table.py"
    source.write_text(module, encoding="utf-8")
    spec = importlib.util.spec_from_file_location("podsrl.reporting.trackers.csv_table", source)
    monkeypatch.setitem(sys.modules, spec.name, importlib.util.module_from_spec(spec))
    spec.loader.exec_module(sys.modules[spec.name])
    entry = eval("{" + line + "}")  # the registry line as written: name -> "module:class"
    for name, target in entry.items():
        monkeypatch.setitem(trackers.TRACKERS, name, target)
    return entry


def test_the_example_is_one_short_file_and_one_line():
    module, line = doc_example()
    assert len([ln for ln in module.splitlines() if ln.strip()]) <= 25
    assert line == '"csv": "podsrl.reporting.trackers.csv_table:CsvTable",'


def test_the_example_tracker_is_chosen_by_name_and_logs_a_resumed_run(registered, tmp_path):
    assert "csv" in normalize_report_to("all")
    cfg = load_config(None, ["log.report_to=[tensorboard, csv]", f"output_dir={tmp_path / 'run'}"])
    assert cfg.log.report_to == ["tensorboard", "csv"]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    logger = build_metrics_logger(cfg, run_dir, resume_step=None)
    for step in (1, 2, 3):
        logger.log({"step": step, "reward": step / 4, "eval/accuracy": float("nan")})
    logger.close()
    resumed = build_metrics_logger(cfg, run_dir, resume_step=2)  # from the checkpoint of step 2: step 3 comes again
    resumed.log({"step": 3, "reward": 1.0})
    resumed.close()
    with open(run_dir / "metrics.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    assert rows == [["1", "reward", "0.25"], ["2", "reward", "0.5"], ["3", "reward", "1.0"]]  # NaN is not a number
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_an_unregistered_tracker_is_refused_naming_the_registered_ones():
    with pytest.raises(ConfigError, match=r"log.report_to: unknown tracker 'csv' \(choose from tensorboard, wandb, "
                                          r"trackio, all, none"):
        load_config(None, ["log.report_to=csv"])


def test_every_registered_tracker_is_a_tracker_of_its_own_module():
    for name, target in trackers.TRACKERS.items():
        cls = trackers.tracker_class(name)
        assert issubclass(cls, trackers.Tracker) and target.startswith("podsrl.reporting.trackers."), name
