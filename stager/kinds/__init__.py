"""Dataset kinds (a tree, an image): one protocol, one table row each (kinds/table.py)."""
