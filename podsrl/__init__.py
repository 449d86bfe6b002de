"""podsrl: reinforcement learning from verifiable rewards that spends compute only on rollouts that teach.

PODS down-sampling, AERO adaptive rollouts and DynaMO allocation/modulation on a clean GRPO core.
"""

__version__ = "0.1.0"
