"""A tool that answers 10 MB costs a step of episodes under 300 MB more memory than a normal answer: the answer is cut
in characters (episode.max_response_chars) before anything tokenizes it (tests/episodes/response_memory.py measures
the peak resident memory of its own process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.checkout import ROOT, pythonpath


def test_a_10_mb_answer_costs_under_300_mb_more_than_a_normal_one():
    result = subprocess.run([sys.executable, "-m", "tests.episodes.response_memory", "10"], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": pythonpath()}, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.splitlines()[-1])
    assert figures["large_mb"] - figures["normal_mb"] < 300, figures
