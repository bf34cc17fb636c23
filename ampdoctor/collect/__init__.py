"""The part of ampdoctor that runs inside training: the Doctor that attach() returns (session.py), a facade over
the core of one run (core.py: the collector, the step loop and its boundary hooks, the step end, the flights, the
replays); the statistics kernels (stats.py, torch); the observation tiers (cadence.py); the live diagnosis thread
(live.py); the precision-loss probe (probe.py, recompute.py). Nothing is imported here: importing
ampdoctor.collect.live (TrainingHalted) loads no torch.
"""
