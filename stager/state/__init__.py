"""The daemon's books: entries, leases, their store, eviction, the state log, each
entry's place under data/."""
