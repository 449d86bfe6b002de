"""Planning a run before it starts, without running it: `podsrl plan --memory` (the memory model, its workload and
report). `podsrl plan`'s step costs are measured by running the trainer: podsrl/experiments/step_costs.py."""
