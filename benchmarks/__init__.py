"""Step-time benchmarks of npugraph_train against eager Lightning, hand-written graphs and torch.compile.

Entry point: ``python benchmarks/step_time.py --help`` (see ``BENCHMARKS.md`` at the repository root).
The suite is not part of the installed package; it imports ``npugraph_train`` from the source tree.
"""
