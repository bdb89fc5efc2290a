"""The planner: pre-staging datasets on the nodes where Slurm plans to start a job
(controller side, docs/prestaging.md): `squeue` reads the queue once an interval,
`planning` computes the prefetch set, `changes` diffs it against the last interval's.
"""
