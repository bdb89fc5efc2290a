"""Scheduling: admission, the staging loop, entries' life, space still held."""
