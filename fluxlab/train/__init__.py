"""Training the embedded model: the synthetic task (task.py), its tokenizer (tokenizer.py), the
block-diffusion objective (objective.py) and the script (train.py, `python -m fluxlab.train`)."""
