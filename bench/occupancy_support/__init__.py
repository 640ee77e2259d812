"""Helpers of bench/occupancy.py and bench/occupancy_airflow.py: the simulated fleet and its sampler, the
task processes, the baseline."""
