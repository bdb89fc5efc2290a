"""``stager-client stage --peers slurm``: stage on every node of the job, reading the
shared storage once.

Run once, in the batch script. SLURM is the orchestrator and the transport: the
per-node work runs as ``srun`` steps (one agent task a node), the bytes move with
``sbcast``; there is no coordinator of ours on the network and no listener. In order:

1. **Probe** every node: its cache key for the request and whether it holds the
   data (a cache hit).
2. **Pick the source node**: a node that holds it (this one if it does), else one
   chosen from the cache key and the sorted node list, so that different datasets
   start on different nodes.
3. **Move the data** to the nodes that lack it, with one step on exactly those
   nodes (sbcast has no node list; it reaches the nodes of a step):

   - *bundle*: the source node stages (or already holds) the dataset, packs the
     ready tree into tars of ~32 MB with a manifest (every path, size and sha256),
     and sbcasts them, packing the next part while one travels; the receivers
     extract each part as it lands. When it stages from the storage, the files it
     finished go out while it stages the rest (early parts, `stager.fanout.early`),
     and the ready tree's parts carry only what those did not. The default.
   - *sources* (``--broadcast sources``): when every source of the request is a
     plain file (release archives), the source node sbcasts them as they are, read
     from the storage once, and every node (itself too) stages from its local copy.

4. **Adopt**: each receiving daemon stages from what it received, through the same
   hardened extraction as any archive, checked against the manifest the source
   node computed, and deletes the delivery. A copy that is missing, truncated or
   different is rejected, and that node stages from the source itself.

The outcome is one line per node; the command fails (naming the node and the
step) only when some node has no data and nothing was left to try.

The modules, one concept each:

    coordinator  `Fanout`: the run above, in the batch script
    agent        `Node`: one node's part (``stager-client _node``, one srun task a node)
    protocol     the JSON lines between them, and the coordinator's end (`Agents`)
    calls        `FanoutCalls`: the daemon's fan-out endpoints (probe, export, incoming)
    policy       which node sends, what and how sbcast sends it (pure functions)
    report       what happened on each node, and the command's output
    slurm        SLURM's own commands: the job, its steps, sbcast

This package imports nothing at import time, so the agent's start-up loads only
what the agent uses.
"""
