"""Staging operations, one module each; :mod:`stager.ops.table` declares them."""
