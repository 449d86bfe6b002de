import pytest

from tests.journeys.user_kit import REWARD_FILE, build_model_dir, gsm8k_rows, long_row, write_data


@pytest.fixture(scope="session")
def user_kit(tmp_path_factory):
    """A user's folder: model/, data/train.{jsonl,csv,parquet} (40 problems and one overlong one), my_rewards.py."""
    home = tmp_path_factory.mktemp("user")
    build_model_dir(home / "model")
    write_data(home / "data", gsm8k_rows(40) + [long_row()])
    (home / "my_rewards.py").write_text(REWARD_FILE)
    return home
