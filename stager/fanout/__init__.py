"""Fan-out of a prepared dataset to the other nodes of a job, over SLURM's sbcast.

The daemon's side only: :mod:`.manifest` (what a copy must be), :mod:`.bundle`
(one file that carries a ready tree). The job-side driver, which runs ``srun`` and
``sbcast``, is :mod:`client._fanout`. Importing this package imports nothing heavy.
"""
