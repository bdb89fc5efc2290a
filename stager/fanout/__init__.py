"""Fan-out of a prepared dataset to the other nodes of a job, over SLURM's sbcast.

The daemon's side only: :mod:`.bundle` (the parts that carry a ready tree); what a
copy must be is a manifest (:mod:`stager.wire.manifest_format`, checked by
:mod:`stager.fs.manifest`). The job-side driver, which runs ``srun`` and ``sbcast``,
is :mod:`client.fanout`. Importing this package imports nothing heavy.
"""
