"""EAGLE-3: the head and its SpecForge-layout files (head.py), training one on text the target
writes itself (data.py, train.py), and the heads shipped with the package (heads/). The drafter
that runs a head in generate() is drafters/eagle.py."""
