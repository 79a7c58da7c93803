"""Training a CED model: the agent corpus (corpus/), the trainer, its dense forward and the copy
probes, and `cedar train` (cli.py). Above the agents (the corpus runs their programs)."""
