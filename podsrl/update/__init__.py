"""The policy update: `PolicyUpdater` (updater.py) over log-probs from the shared-prompt path (shared_prompt.py,
computed by podsrl/models/packed.py) or the plain reference path (plain.py); AdamW and its LR schedule
(optimizer.py); `UpdateSettings` (settings.py), what the update reads of the config."""

from podsrl.update.settings import UpdateSettings
from podsrl.update.updater import PolicyUpdater

__all__ = ["PolicyUpdater", "UpdateSettings"]
