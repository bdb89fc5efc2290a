"""A request's checks and expansion: sources, recipes, the cache key."""
