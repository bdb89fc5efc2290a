# Guarded: a multiprocessing child must never run the CLI again if it imports this module.
if __name__ == "__main__":
    import gc

    # No collections while the command imports (a daemon's 600-800 modules, its app):
    # nothing made there is garbage, and full collections over it were ~8% of a
    # daemon's start. ``stager.cli.main`` turns the collector back on: at once for a
    # command, after ``stager serve`` has frozen what it loaded (stager.api.server).
    gc.disable()
    from stager.cli import main

    raise SystemExit(main())
