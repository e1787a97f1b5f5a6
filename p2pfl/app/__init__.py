"""The application: the command line, experiment files (validation, defaults, plug-ins),
building a run, sweeps, and the communication-cost analysis."""
