"""podsrl: reinforcement learning from verifiable rewards that spends compute only on rollouts that teach.

Rollout-efficiency methods (podsrl.methods), each a plug-in on one clean GRPO core.
"""

__version__ = "0.1.0"
