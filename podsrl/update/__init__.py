"""The policy update: `PolicyUpdater` (updater.py) over log-probs from the shared-prompt path (shared_prompt.py,
computed by podsrl/models/packed.py) or the plain reference path (plain.py); AdamW and its LR schedule
(optimizer.py)."""

from podsrl.update.updater import PolicyUpdater

__all__ = ["PolicyUpdater"]
