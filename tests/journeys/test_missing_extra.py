"""Installed without the `tasks` extra, a dataset task stops at start-up with one line naming the extra, instead of
training with every `correct` reward zeroed by dying math-verify workers."""


from tests.journeys.user_kit import podsrl, user_config

WITHOUT_MATH_VERIFY = "import sys, runpy; sys.modules['math_verify'] = None; runpy.run_module('podsrl.cli', " \
                      "run_name='__main__')"


def test_missing_math_verify_stops_at_start_up(user_kit):
    cfg = user_config(user_kit, "noextra", "data/train.jsonl")
    done = podsrl("train", "--config", str(cfg), cwd=user_kit, python_args=["-c", WITHOUT_MATH_VERIFY])
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("podsrl: error:")]
    assert errors == ["podsrl: error: the 'correct' reward of task 'dataset:train.jsonl' (math-verify against the "
                      "gold answer) needs the optional package 'math-verify', which is not installed: pip install "
                      "'podsrl[tasks]' (or pip install math-verify)"]
    assert "Traceback" not in done.stderr and not (user_kit / "runs" / "noextra" / "metrics.jsonl").exists()
