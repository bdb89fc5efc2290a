# Guarded: a multiprocessing child must never run the CLI again if it imports this module.
if __name__ == "__main__":
    import gc

    # No collections while the command imports (a daemon's ~800 modules, its app):
    # almost nothing made there is garbage (a collection at the freeze would find
    # ~1,200 objects of ~80,000), and the collections over it were ~0.1 s of a
    # daemon's ~0.9 s of CPU at its start. ``stager.cli.main`` turns the collector back
    # on: at once for a command, for ``stager serve`` once it has frozen what it
    # loaded (stager.api.server).
    gc.disable()
    from stager.cli import main

    raise SystemExit(main())
