"""Single-field bounds are declared on the fields (`option(..., ge=1)`): each refuses a value just outside it with
one line naming the key, the defaults lie within, and the reference page shows them."""

from __future__ import annotations

import pytest

from podsrl.config import ConfigError, config_reference_markdown, load_config
from podsrl.config.reference import config_fields
from podsrl.options import Bounds, field_bounds

BOUNDED = [(key, field_bounds(f), f.default) for key, f in config_fields() if field_bounds(f) is not None]


def outside(bounds: Bounds, default: object) -> list[float]:
    """A value just outside each side of the range, of the field's type (an int field takes whole numbers)."""
    step = 1 if isinstance(default, int) else 0.5
    return [v for v in (bounds.ge - step if bounds.ge is not None else None, bounds.gt,
                        bounds.le + step if bounds.le is not None else None, bounds.lt) if v is not None]


def test_the_core_ranges_are_declared_on_their_fields():
    keys = {key for key, _, _ in BOUNDED}
    assert {"rollout.n", "optim.lr", "rollout.top_p", "train.async.max_staleness", "model.tiny.num_heads",
            "output_dir", "model.dtype", "optim.betas"} <= keys
    assert len(keys) >= 60


RANGES = [b for b in BOUNDED if b[1].range_text()]


@pytest.mark.parametrize("key,bounds,default", RANGES, ids=[key for key, _, _ in RANGES])
def test_a_value_outside_a_range_is_one_line_naming_the_key(key, bounds, default):
    for value in outside(bounds, default):
        with pytest.raises(ConfigError) as raised:
            load_config(None, [f"{key}={value}"])
        assert str(raised.value) == f"{key}: must be {bounds.range_text()}"


def test_the_refusals_of_a_test_and_the_messages_they_keep():
    cases = {"model.tiny.num_heads=3": "model.tiny.num_heads: must be even (or 1)",
             "model.tiny.num_heads=0": "model.tiny.num_heads: must be >= 1",  # was a ZeroDivisionError
             "optim.betas=[0.9]": "optim.betas: needs two values",
             "output_dir=": "output_dir: must not be empty",
             "optim.lr=-1": "optim.lr: must be > 0",
             "rollout.top_p=0": "rollout.top_p: must be in (0, 1]",
             "task.eval_fraction=1": "task.eval_fraction: must be in [0, 1)",
             "algo.advantage_clip=-1": "algo.advantage_clip: must be >= 0 (0 = off)",
             "algo.epsilon_high=-1": "algo.epsilon_high: must be >= 0"}  # was keyed on algo.epsilon_low
    for override, message in cases.items():
        with pytest.raises(ConfigError) as raised:
            load_config(None, [override])
        assert str(raised.value) == message
    with pytest.raises(ConfigError, match=r"^model.dtype: float16 is refused: podsrl has no loss scaling"):
        load_config(None, ["model.dtype=float16"])


def test_the_defaults_are_in_bounds_and_the_reference_shows_the_bounds():
    load_config()  # every default passes its own bounds
    page = config_reference_markdown()
    assert "| `rollout.top_p` | `1.0` | in (0, 1] |" in page
    assert "| `optim.micro_batch_size` | `0` | >= 0 (0 = auto) |" in page
