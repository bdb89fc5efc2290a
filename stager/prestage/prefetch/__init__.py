"""Pre-staging, the node side: prefetches ordered by Slurm's identity (docs/prestaging.md)."""
