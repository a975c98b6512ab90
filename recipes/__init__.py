"""The recipes as modules (`from recipes import ppo`); each also runs as a script: `python recipes/sft.py`."""
