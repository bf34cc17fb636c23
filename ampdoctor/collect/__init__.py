"""The part of ampdoctor that runs inside training: the Doctor that attach() returns (session.py) with its
callbacks, step boundary, per-step record and site registry; the statistics kernels (stats.py, torch); the
observation tiers (cadence.py); the live diagnosis thread (live.py); the precision-loss probe (probe.py,
recompute.py). Nothing is imported here: importing ampdoctor.collect.live (TrainingHalted) loads no torch.
"""
