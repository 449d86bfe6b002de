"""Multi-turn episodes: a task gives each problem an environment (environment.py) whose tools (tools.py) the model
calls; the runner (runner.py) advances all live episodes of a generate call together, turn by turn, rendering the
environment's messages with the chat template (render.py) and counting what happened (stats.py)."""
