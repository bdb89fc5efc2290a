from stager.cli import main

# Guarded: a multiprocessing child must never run the CLI again if it imports this module.
if __name__ == "__main__":
    raise SystemExit(main())
