"""Leaves every floor stands on: settings, errors, durable writes, libc, metrics."""
