"""The memory model of a step, planned before a run without running it: the model's shape and the step's workload
(workload.py), the predicted peaks of generation and of the update (memory.py, attention.py) and of start-up
(startup.py). It reads no config, so the engines stand on it (the fast engine sizes its KV cache with it);
podsrl/memory_plan.py applies it to a config (`podsrl plan --memory`). `podsrl plan`'s step costs are measured by
running the trainer: podsrl/experiments/step_costs.py."""
