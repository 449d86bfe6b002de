"""Environments of other libraries as podsrl environments (`podsrl.episodes.environment.Environment`)."""
