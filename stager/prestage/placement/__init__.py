"""Cache-aware placement: node features for the data a node holds (docs/prestaging.md)."""
