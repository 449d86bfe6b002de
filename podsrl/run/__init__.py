"""The run: the trainer (the learner) and the batch producer, train.async's generator, evaluation, the
warm-up, checkpoints and what a run keeps and logs (locks, health, accounting, tracking)."""
