"""Training an EAGLE-3 head for a target (`specfast train-eagle`): the text the target writes
itself as data (data.py, from the prompts in prompts.py and the benchmark's workloads), the
training loop and held-out acceptance (fit.py), and the command's job (job.py). The head and
its drafter are specfast.drafters.eagle."""
