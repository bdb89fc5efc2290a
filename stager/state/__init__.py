"""The daemon's books: entries, leases, their store, eviction, the state log."""
