"""``import wandb`` fails here as it does where the optional extra is not installed (tests/conftest.py puts this
folder first on the path of the suite's subprocesses; test_wandb.py takes it out)."""
raise ModuleNotFoundError("No module named 'wandb'", name="wandb")
