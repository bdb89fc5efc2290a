"""The planner: pre-staging datasets on the nodes where Slurm plans to start a job.

Controller side, one Slurm call per interval for the whole cluster: `squeue` reads
every pending job's planned start, planned nodes and declaration (the ``#STAGER``
lines job_submit.lua copied into its AdminComment); `planning` computes the prefetch
set for the jobs that start within the horizon; `changes` diffs it against the last
interval's. docs/prestaging.md.
"""
