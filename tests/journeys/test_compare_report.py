"""Two methods on the user's own model and data through `podsrl compare`, then `podsrl report`."""

from tests.journeys.user_kit import GRPO, PODS, ok, podsrl, user_config


def test_compare_two_presets_and_report(user_kit):
    grpo = user_config(user_kit, "grpo", "data/train.parquet", method=GRPO)
    pods = user_config(user_kit, "pods", "data/train.parquet", method=PODS)
    out = user_kit / "cmp"
    ok(podsrl("compare", str(grpo), str(pods), "--seeds", "1", "--budget-rollouts", "16", "--out", str(out),
              "--no-progress", cwd=user_kit))
    for name in ("grpo", "pods"):
        assert (out / name / "seed1" / "summary.json").is_file()
    table = (out / "results.md").read_text()
    assert "grpo" in table and "pods" in table
    rebuilt = user_kit / "rebuilt"
    ok(podsrl("report", str(out), "--out", str(rebuilt), cwd=user_kit))
    assert (rebuilt / "results.csv").read_text() == (out / "results.csv").read_text()
