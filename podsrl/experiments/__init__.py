"""What runs the loop to measure it: `podsrl compare` (runner.py) with its report (report.py, analysis.py,
stats.py, plots.py), and `podsrl plan`'s step costs, measured on real steps (step_costs.py)."""
