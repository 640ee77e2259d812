"""Helpers of bench/occupancy.py: the simulated fleet and its sampler, the task processes, the baseline."""
